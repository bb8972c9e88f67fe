"""The fp8 einsum's decode-kernel plans under ncu: each case of benchmarks/profile_case.py at several forced plans
(needs einsum_decode_plan_override.patch applied and built: JAX_W4A8_DECODE_PLAN=warps,cluster,staged,depth),
printing the (case, plan) order of the launches for seqdur.py. From the repository root, on the GPU machine:

    SWEEP2=1 XLA_FLAGS=--xla_gpu_enable_command_buffer= ncu --clock-control none --kernel-name regex:Fp8Decode \
        --metrics gpu__time_duration.sum python3 benchmarks/experiments/plan_sweep.py > sweep.txt
    grep SEQ sweep.txt > seq.txt; python3 benchmarks/experiments/seqdur.py sweep.txt seq.txt
"""
import os, sys
sys.path.insert(0, "benchmarks")
import jax
from profile_case import EINSUM_CASES, _einsum_case
SWEEP = {
    "qkv_a1": ["", "4,4,0,3", "4,4,0,4", "4,2,0,2", "4,2,0,4", "4,8,0,2", "2,8,0,2", "2,8,0,4", "4,1,0,4", "4,2,1,2", "4,1,1,2"],
    "q_b1": ["", "4,1,0,3", "2,1,0,2", "2,1,0,4", "2,1,0,3", "1,1,0,4", "4,1,1,2", "2,1,1,2"],
    "shared_up1": ["", "4,2,0,3", "4,2,0,4", "4,1,0,4", "4,1,1,2", "2,2,0,4", "4,4,0,2", "2,1,1,2"],
    "shared_down1": ["", "4,1,0,3", "4,1,0,4", "2,1,0,4", "2,1,0,2", "4,1,1,2", "2,1,1,2", "4,2,0,2"],
    "kv_a1": ["", "2,8,0,2", "4,4,0,4", "4,8,0,4", "4,4,0,2"],
    "o_proj1": ["", "4,1,0,4", "4,1,0,3", "4,1,0,2", "4,2,1,2"],
    "square1": ["", "4,1,0,4", "4,1,0,2", "4,1,0,3"],
    "absorb_o1": ["", "4,1,0,4", "2,1,0,2"],
}
if os.environ.get("SWEEP2"):
    SWEEP = {
        "shared_up1": ["", "4,2,1,2", "4,1,1,2"],
        "qkv_a1": ["", "4,2,1,2", "4,2,0,2"],
        "q_a1": ["", "4,4,0,2", "4,2,1,2", "4,2,0,2"],
        "q_b1": ["", "2,1,1,2", "2,1,0,2"],
        "wo_a1": ["", "2,1,1,2", "4,2,1,2"],
        "mlp_up1": ["", "4,2,1,2"],
        "shared_down1": ["", "2,1,1,2"],
    }
calls = int(os.environ.get("CALLS", "3"))
only = sys.argv[1:] or list(SWEEP)
for name in only:
    fn, args = _einsum_case(jax.random.key(0), *EINSUM_CASES[name])
    os.environ.pop("JAX_W4A8_DECODE_PLAN", None)
    fn(*args).block_until_ready()  # compile, one default launch
    print(f"SEQ {name} warmup x1", flush=True)
    for plan in SWEEP[name]:
        if plan: os.environ["JAX_W4A8_DECODE_PLAN"] = plan
        else: os.environ.pop("JAX_W4A8_DECODE_PLAN", None)
        for _ in range(calls): fn(*args).block_until_ready()
        print(f"SEQ {name} {plan or 'default'} x{calls}", flush=True)
