"""A patched HuggingFace Llama (or Qwen3-MoE) trained under DDP or FSDP2 gives the single-process
losses.

    torchrun --nproc-per-node 2 scripts/distributed_check.py --mode ddp [--family qwen3_moe]
    torchrun --nproc-per-node 2 scripts/distributed_check.py --mode fsdp2 [--lm-head-unit]

Every rank builds the same model from a config (seeded; no download), patches it with
tritonformer.integrations.hf, and trains --steps steps of AdamW on its share of one global batch
(rank r takes rows r::world). Rank 0 first trains an identical model alone on the whole batch.
Each rank's loss is the mean over its tokens (equal counts), so the mean over ranks of the
distributed losses must match the single-process losses step by step; the script prints both
and exits non-zero if they differ by more than --tolerance (relative).

FSDP2: every decoder layer is a unit and the root holds the embedding and lm_head (HF's
`keep_full_weight` plan for lm_head), so the fused linear cross-entropy sees the gathered
lm_head weight; the output's logits are None, which the script checks. --lm-head-unit makes
lm_head a unit of its own: its weight is then a shard outside its own forward, and the patched
forward takes the logits path instead (checked too). NCCL on GPUs, gloo on CPUs (the
interpreter: use --tiny).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch
import torch.distributed as dist


def build(args, device):
    import transformers

    torch.manual_seed(0)
    if args.tiny:
        sizes = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32)
        experts = dict(num_experts=4, moe_intermediate_size=64, num_experts_per_tok=2)
    else:
        sizes = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=2, head_dim=128)
        experts = dict(num_experts=16, moe_intermediate_size=512, num_experts_per_tok=4)
    if args.family == "qwen3_moe":
        # Every layer sparse; the experts' weights are sharded by FSDP2 along the experts.
        cfg = transformers.Qwen3MoeConfig(**sizes, **experts, norm_topk_prob=True, max_position_embeddings=args.seq)
    else:
        cfg = transformers.LlamaConfig(**sizes, max_position_embeddings=args.seq)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(device=device, dtype=args.dtype)
    data = torch.randint(0, cfg.vocab_size, (args.steps, args.batch, args.seq),
                         generator=torch.Generator().manual_seed(1)).to(device)
    return model, data


def train(model, data, rows, steps):
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, fused = [], []
    for step in range(steps):
        ids = data[step][rows]
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.detach().float())
        fused.append(out.logits is None)
    return losses, fused


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["ddp", "fsdp2"], required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (for the CPU interpreter)")
    p.add_argument("--family", default="llama", choices=["llama", "qwen3_moe"],
                   help="the model: Llama, or Qwen3-MoE (issue 46: mixture of experts)")
    p.add_argument("--lm-head-unit", action="store_true", help="FSDP2: lm_head as its own unit")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--tolerance", type=float, default=None, help="relative (default 1e-3 fp32, 2e-2 bf16)")
    args = p.parse_args()
    args.dtype = getattr(torch, args.dtype)
    tolerance = args.tolerance or (1e-3 if args.dtype == torch.float32 else 2e-2)
    import tritonformer  # noqa: F401  (before transformers: picks the interpreter on a CPU machine)
    from tritonformer.integrations import hf

    on_gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be a multiple of the world size {world}")

    model, data = build(args, device)
    single = copy.deepcopy(model)
    hf.patch(model)
    if rank == 0:
        hf.patch(single)
        reference, _ = train(single, data, slice(None), args.steps)
        reference = [x.item() for x in reference]
    del single

    if args.mode == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if on_gpu else None)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        if args.lm_head_unit:
            fully_shard(model.lm_head, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped = model
    losses, fused = train(wrapped, data, slice(rank, None, world), args.steps)
    mean = torch.stack(losses)
    dist.all_reduce(mean)
    mean = (mean / world).tolist()
    expect_fused = not (args.mode == "fsdp2" and args.lm_head_unit)
    ok_fused = all(f == expect_fused for f in fused)
    if rank == 0:
        worst = max(abs(a - b) / abs(b) for a, b in zip(mean, reference))
        ok = worst <= tolerance and ok_fused
        print(json.dumps({"family": args.family, "mode": args.mode, "lm_head_unit": args.lm_head_unit, "world": world,
                          "device": device.type, "dtype": str(args.dtype), "single": reference, "distributed": mean,
                          "max_relative_difference": worst, "tolerance": tolerance,
                          "fused_loss": fused[0], "ok": ok}))
        code = 0 if ok else 1
    else:
        code = 0 if ok_fused else 1
    dist.destroy_process_group()
    sys.exit(code)


if __name__ == "__main__":
    main()
