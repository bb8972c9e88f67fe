"""scripts/gpu_tests.py, the parallel pytest runner for the GPU tests, on throwaway test files (CPU)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_tests.py")

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gpu_tests  # noqa: E402


def _run(tmp_path, *args):
    return subprocess.run([sys.executable, SCRIPT, "--cwd", str(tmp_path), "--logs", str(tmp_path / "logs"), *args],
                          capture_output=True, text=True, timeout=300)


def _write(tmp_path, name, body):
    (tmp_path / name).write_text(body)


def test_every_selected_test_runs_once_across_the_shards(tmp_path):
    _write(tmp_path, "test_a.py", "import os, pytest\n"
           "@pytest.mark.parametrize('i', range(7))\n"
           "def test_a(i):\n"
           "    with open('seen.txt', 'a') as f: f.write(f'{i} {os.environ[\"XLA_PYTHON_CLIENT_MEM_FRACTION\"]}\\n')\n")
    _write(tmp_path, "test_b.py", "def test_b():\n    pass\n")
    r = _run(tmp_path, "--shards", "3", "--", "-k", "test_a", "test_a.py", "test_b.py")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "7 tests in 3 processes" in r.stdout and "gpu_tests: passed" in r.stdout
    seen = (tmp_path / "seen.txt").read_text().split("\n")[:-1]
    assert sorted(int(s.split()[0]) for s in seen) == list(range(7))  # each once, test_b deselected
    assert {s.split()[1] for s in seen} == {"0.300"}  # 0.9 / 3 shards
    assert sorted(os.listdir(tmp_path / "logs")) == ["shard_0.log", "shard_1.log", "shard_2.log"]


def test_tests_marked_alone_run_after_the_others_with_the_gpu_to_themselves(tmp_path):
    """compute-sanitizer's tests (``@pytest.mark.alone``) run after every shard has finished, in one process with 0.9
    of the GPU: the sixty-fifth session's H100 saw synccheck fail once beside four test processes, and pass alone."""
    _write(tmp_path, "test_a.py", "import pytest\n"
           "@pytest.mark.parametrize('i', range(5))\n"
           "def test_a(i):\n"
           "    with open('seen.txt', 'a') as f: f.write(f'{i}\\n')\n")
    _write(tmp_path, "test_s.py", "import os, pytest\n"
           "@pytest.mark.alone\n"
           "@pytest.mark.parametrize('tool', ['memcheck', 'racecheck'])\n"
           "def test_s(tool):\n"
           "    done = open('seen.txt').read().split()\n"
           "    with open('alone.txt', 'a') as f:\n"
           "        f.write(f'{tool} {len(done)} {os.environ[\"XLA_PYTHON_CLIENT_MEM_FRACTION\"]}\\n')\n")
    r = _run(tmp_path, "--shards", "3", "--", "test_s.py", "test_a.py")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "7 tests, 5 in 3 processes, 0.30 of GPU memory each, then 2 alone with 0.90" in r.stdout, r.stdout
    assert "alone: 2 passed" in r.stdout, r.stdout
    # both ran after all five others, in one process with 0.9 of the GPU
    assert sorted((tmp_path / "alone.txt").read_text().split("\n")[:-1]) == ["memcheck 5 0.900", "racecheck 5 0.900"]
    assert sorted(os.listdir(tmp_path / "logs")) == ["alone.log", "shard_0.log", "shard_1.log", "shard_2.log"]
    # a failure there fails the run and is named
    _write(tmp_path, "test_s.py", "import pytest\n@pytest.mark.alone\ndef test_s():\n    assert False, 'synccheck'\n")
    r = _run(tmp_path, "--shards", "2", "--", "test_s.py", "test_a.py")
    assert r.returncode == 1 and "FAILED test_s.py::test_s" in r.stdout and "synccheck" in r.stdout, r.stdout


def test_a_failure_in_any_shard_fails_the_run_and_is_named(tmp_path):
    _write(tmp_path, "test_c.py", "import pytest\n"
           "@pytest.mark.parametrize('i', range(6))\n"
           "def test_c(i):\n    assert i != 4, 'four'\n")
    r = _run(tmp_path, "--shards", "4", "--mem-fraction", "0.2", "test_c.py")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAILED test_c.py::test_c[4]" in r.stdout and "gpu_tests: FAILED" in r.stdout
    # the assertion's message comes back on the console (the shard logs stay on the machine that ran them)
    assert any(ln.strip().startswith("E ") and "four" in ln for ln in r.stdout.splitlines()), r.stdout
    assert sum("passed" in ln for ln in r.stdout.splitlines() if ln.startswith("shard ")) == 4


def test_a_collection_error_stops_before_running(tmp_path):
    _write(tmp_path, "test_d.py", "import no_such_module_here\n")
    r = _run(tmp_path, "test_d.py")
    assert r.returncode != 0 and "collecting test_d.py failed" in r.stderr


def test_nothing_selected_passes(tmp_path):
    _write(tmp_path, "test_e.py", "def test_e():\n    pass\n")
    r = _run(tmp_path, "-k", "nothing_matches", "test_e.py")
    assert r.returncode == 0 and "0 tests in 0 processes" in r.stdout, r.stdout + r.stderr


def test_deal_spreads_neighbours_and_drops_empty_shards():
    assert gpu_tests.deal(list("abcde"), 2) == [["a", "c", "e"], ["b", "d"]]
    assert gpu_tests.deal(list("ab"), 4) == [["a"], ["b"]]


def test_shards_shrink_to_give_each_process_its_minimum_memory():
    assert gpu_tests.fit_shards(8, 139.8, 12.0) == 8  # H200: 15.7 GiB each
    assert gpu_tests.fit_shards(8, 79.6, 12.0) == 5  # H100 80 GB: 14.3 GiB each instead of 9.0
    assert gpu_tests.fit_shards(4, 79.6, 12.0) == 4
    assert gpu_tests.fit_shards(8, 8.0, 12.0) == 1  # a small GPU still runs one process
    assert gpu_tests.fit_shards(8, None, 12.0) == 8  # no nvidia-smi: as asked
    assert gpu_tests.fit_shards(8, 79.6, 0.0) == 8  # turned off


def test_bad_arguments_are_named(tmp_path):
    r = _run(tmp_path, "--shards", "0", "x.py")
    assert r.returncode == 2 and "--shards" in r.stderr
    r = _run(tmp_path, "--mem-fraction", "1.5", "x.py")
    assert r.returncode == 2 and "--mem-fraction" in r.stderr
