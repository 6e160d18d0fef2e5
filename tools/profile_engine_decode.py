"""Profile the engine's decode steps (SmolLM2, paged, torch on 1 thread) with torch.profiler:
B random prompts of P tokens prefilled, then 8 decode steps timed and 3 profiled.

    .venv/bin/python tools/profile_engine_decode.py [B=8] [P=1024] [KERNEL_THREADS=1]

Prints the decode step times and the profiler table (kvtvm's append and attention calls as
their own rows; ``aten::mm`` or ``mkldnn::_linear_pointwise`` for the linear layers).
"""
import os, sys, time, numpy as np, torch
from torch.profiler import ProfilerActivity, profile
import kvtvm.plan as plan
from kvtvm.engine import Engine, Request, load_model
model, _ = load_model("smollm2")
B, P = int(sys.argv[1]), int(sys.argv[2])
kt = int(sys.argv[3]) if len(sys.argv) > 3 else 1
rng = np.random.default_rng(0)
e = Engine(model, "paged", max_batch_size=B, max_seq_len=P + 64, prefix_caching=False,
           eos_token_ids=(), max_step_tokens=2048, torch_threads=1, kernel_threads=kt)
e.log = lambda s: None
for i in range(B):
    e.submit(Request(i, rng.integers(100, 40000, P).tolist(), 40))
t0 = time.perf_counter()
while any(r.prefilled < len(r.prompt) for r in e.running + e.queue) or not e.running:
    e.step()
print("prefill s", time.perf_counter() - t0, os.getloadavg())
ts = []
for _ in range(8):
    t0 = time.perf_counter(); e.step(); ts.append(time.perf_counter() - t0)
print("decode step ms", [round(1e3 * t) for t in ts])
def labelled(fn, name):
    def w(self, *a, **k):
        with torch.profiler.record_function(name):
            return fn(self, *a, **k)
    return w
plan.StepPlan.append_kv = labelled(plan.StepPlan.append_kv, "kvtvm append_kv")
plan.StepPlan.attention = labelled(plan.StepPlan.attention, "kvtvm attention")
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(3):
        e.step()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=40))
