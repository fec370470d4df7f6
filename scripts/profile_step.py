"""GPU time of one training step of bench e2e's model, by kernel (torch.profiler), for one stack.

    python scripts/profile_step.py [--stack tritonformer|hf-eager|hf+liger] [--top 30]
"""

import argparse
import collections

import torch

import tritonformer  # noqa: F401  (before transformers)
from tritonformer.bench.e2e import FULL

parser = argparse.ArgumentParser()
parser.add_argument("--stack", default="tritonformer")
parser.add_argument("--top", type=int, default=30)
args = parser.parse_args()

if args.stack == "hf+liger":
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    apply_liger_kernel_to_llama()
import transformers  # noqa: E402

s = FULL
torch.manual_seed(0)
config = transformers.LlamaConfig(
    vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
    num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"])
model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to("cuda", torch.bfloat16)
if args.stack == "tritonformer":
    from tritonformer.integrations import hf
    hf.patch(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
data = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), device="cuda")


def step():
    loss = model(input_ids=data, labels=data).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


for _ in range(5):
    step()
torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(2):
        step()
    torch.cuda.synchronize()
per_kernel = collections.defaultdict(float)
count = collections.Counter()
for e in prof.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
        per_kernel[e.name[:90]] += e.device_time_total / 2 / 1e3
        count[e.name[:90]] += 1
total = sum(per_kernel.values())
print(f"{args.stack}: GPU time per step {total:.1f} ms")
for name, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[: args.top]:
    print(f"  {ms:7.2f} ms  x{count[name] // 2:<4d} {name}")
