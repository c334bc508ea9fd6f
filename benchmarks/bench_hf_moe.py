#!/usr/bin/env python
"""Loading a mixture-of-experts Hugging Face checkpoint into a sharded model: region reads against
the obvious way.

The checkpoint is made by transformers itself: a Qwen3-MoE of ``--layers`` layers and ``--experts``
experts per layer, saved with ``save_pretrained`` (separate q/k/v, one gate/up/down tensor per
expert: ``3 * layers * experts`` expert tensors, thousands with the defaults). The model loaded
into has one grouped ``linear_qkv`` per attention (:class:`InterleaveQKV`) and stacked experts
(transformers' own conversion mapping), every matrix ``Shard(0)`` over ``--ranks`` gloo ranks (a
rank holds ``experts / ranks`` experts of each layer) and every vector replicated; each rank
builds only its own shards.

Two loaders, the same rules, checked equal bit for bit after the last repetition:

- obvious (``load_whole_tensors``, the legacy loader): each rank reads every tensor whole,
  converts in memory (stacks all experts of a layer), keeps its slice;
- planner (``load_hf_checkpoint`` with :class:`HFLoadPlanner`): each rank reads only the regions
  of the checkpoint its shards need.

Reported per loader: seconds of the slowest rank (best / median of ``--reps``; the loaders
alternate, so a change in the machine's load hits both), the CPU seconds of the busiest rank (what
the load costs whatever else the machine runs), and the peak extra memory of the worst rank: the
process's peak resident set during the load (``VmHWM``, reset before each repetition through
``/proc/self/clear_refs``) minus its resident set just before. ``--profile`` writes a cProfile of
rank 0's last load of one loader.

Usage::

    python benchmarks/bench_hf_moe.py                          # 8 layers x 64 experts, 4 ranks
    python benchmarks/bench_hf_moe.py --layers 4 --experts 128 --hidden 512
    python benchmarks/bench_hf_moe.py --reps 2 --checkpoint /tmp/moe --profile /tmp/planner.prof
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.common import table_head, table_row  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 8, 4, 32


def config(a: argparse.Namespace):
    import transformers

    return transformers.Qwen3MoeConfig(
        vocab_size=1024, hidden_size=a.hidden, intermediate_size=2 * a.hidden, moe_intermediate_size=a.expert_dim,
        num_hidden_layers=a.layers, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        num_experts=a.experts, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
        tie_word_embeddings=False)


def make_checkpoint(a: argparse.Namespace, path: str) -> int:
    """Save a random Qwen3-MoE with transformers; returns how many tensors the checkpoint holds."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config(a)).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    model.save_pretrained(path)
    return count_tensors(path)


def count_tensors(path: str) -> int:
    """How many tensors the checkpoint in ``path`` holds."""
    from safetensors import safe_open

    count = 0
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                count += len(list(f.keys()))
    return count


def rules():
    from hyper_parallel.components.checkpoint import InterleaveQKV, WeightConverter

    return [WeightConverter(["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
                            "self_attn.linear_qkv.weight",
                            [InterleaveQKV(KV_HEADS, HEADS // KV_HEADS, HEAD_DIM, HEAD_DIM, False)])]


def sharded_model(a: argparse.Namespace, mesh):
    """The fused model, each rank holding only its shards (built on the meta device, then local zeros)."""
    import torch
    import transformers
    from torch import nn
    from torch.distributed.tensor import DTensor, Replicate, Shard

    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(config(a)).to(torch.bfloat16)
        for layer in model.model.layers:
            attention = layer.self_attn
            del attention.q_proj, attention.k_proj, attention.v_proj
            attention.linear_qkv = nn.Linear(a.hidden, (HEADS + 2 * KV_HEADS) * HEAD_DIM, bias=False,
                                             dtype=torch.bfloat16)
    ranks, rank = mesh.size(), mesh.get_local_rank()
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            shape = tuple(param.shape)
            if len(shape) >= 2:
                rows = [len(r) for r in torch.arange(shape[0]).chunk(ranks)] + [0] * ranks
                local = torch.zeros((rows[rank], *shape[1:]), dtype=param.dtype)
                placement = Shard(0)
            else:
                local, placement = torch.zeros(shape, dtype=param.dtype), Replicate()
            stride = torch.empty(shape, device="meta").stride()
            tensor = DTensor.from_local(local, mesh, [placement], run_check=False, shape=torch.Size(shape),
                                        stride=stride)
            module._parameters[name] = nn.Parameter(tensor, requires_grad=False)
    return model


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def rank_main(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hyper_parallel.components.checkpoint import HFLoadPlanner, load_hf_checkpoint
    from hyper_parallel.components.checkpoint.whole_tensor_loader import load_whole_tensors

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + a.store, rank=a.rank, world_size=a.ranks)
    mesh = init_device_mesh("cpu", (a.ranks,))
    loaders = {
        "obvious: whole tensors, convert, slice": lambda m: load_whole_tensors(
            m, a.ckpt, extra_weights_mapping=rules()),
        "planner: region reads": lambda m: load_hf_checkpoint(
            m, a.ckpt, planner=HFLoadPlanner(m, extra_weights_mapping=rules())),
    }
    out: dict[str, dict[str, list[float]]] = {name: {"seconds": [], "extra_bytes": [], "cpu_seconds": []}
                                                  for name in loaders}
    last = {}
    for rep in range(a.reps):  # the loaders alternate, so a change in the machine's load hits both alike
        order = list(loaders) if rep % 2 == 0 else list(reversed(loaders))
        for name in order:
            model = sharded_model(a, mesh)
            gc.collect()
            dist.barrier()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident set
            before = _status("VmRSS")
            profiled = a.profile and a.rank == 0 and name.startswith(a.profile_loader)
            profiler = cProfile.Profile(time.process_time) if profiled else None
            start, cpu_start = time.perf_counter(), time.process_time()
            if profiler is not None:
                profiler.runcall(loaders[name], model)
            else:
                loaders[name](model)
            seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            if profiler is not None:
                profiler.dump_stats(a.profile)
            extra = _status("VmHWM") - before
            both = torch.tensor([seconds, float(extra), cpu], dtype=torch.float64)
            dist.all_reduce(both, op=dist.ReduceOp.MAX)
            out[name]["seconds"].append(both[0].item())
            out[name]["extra_bytes"].append(both[1].item())
            out[name]["cpu_seconds"].append(both[2].item())
            last[name] = model
            del model
    a_sd, b_sd = (last[name].state_dict() for name in loaders)
    equal = all(torch.equal(a_sd[k].to_local(), b_sd[k].to_local()) for k in a_sd)
    flag = torch.tensor([int(equal)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    out["equal"] = bool(flag.item())
    if a.rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--expert-dim", type=int, default=128, help="moe_intermediate_size")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary directory)")
    ap.add_argument("--profile", default=None, metavar="FILE",
                    help="cProfile rank 0's loads of one loader (--profile-loader), in CPU time, and write the stats "
                         "of the last repetition to FILE (read it with python -m pstats FILE)")
    ap.add_argument("--profile-loader", default="planner", choices=("planner", "obvious"),
                    help="which loader --profile profiles (default: planner)")
    ap.add_argument("--checkpoint", default=None, metavar="DIR",
                    help="use the checkpoint in DIR, saving it there first when DIR does not exist yet, and keep it "
                         "(default: save one in a temporary directory, removed afterwards)")
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank is not None:
        rank_main(a)
        return
    where = tempfile.mkdtemp(prefix="bench_hf_moe_", dir=a.dir)
    try:
        ckpt = os.path.abspath(a.checkpoint) if a.checkpoint else os.path.join(where, "ckpt")
        count = make_checkpoint(a, ckpt) if not os.path.isdir(ckpt) else count_tensors(ckpt)
        size = sum(os.path.getsize(os.path.join(ckpt, n)) for n in os.listdir(ckpt) if n.endswith(".safetensors"))
        args = [sys.executable, os.path.abspath(__file__), "--layers", str(a.layers), "--experts", str(a.experts),
                "--hidden", str(a.hidden), "--expert-dim", str(a.expert_dim), "--ranks", str(a.ranks),
                "--reps", str(a.reps), "--profile-loader", a.profile_loader,
                *(["--profile", os.path.abspath(a.profile)] if a.profile else []),
                "--store", os.path.join(where, "store"), "--ckpt", ckpt]
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
        load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
        procs = [subprocess.Popen([*args, "--rank", str(r)], stdout=subprocess.PIPE, text=True, env=env)
                 for r in range(a.ranks)]
        outs = [p.communicate(timeout=3600)[0] for p in procs]
        if any(p.returncode for p in procs):
            sys.exit(f"a rank failed: return codes {[p.returncode for p in procs]}")
    finally:
        shutil.rmtree(where, ignore_errors=True)
    result = json.loads(outs[0].strip().splitlines()[-1])
    expert_slice = a.expert_dim * a.hidden * 2  # one expert's gate (or up, or down) matrix, bf16
    print(f"Qwen3-MoE by transformers: {a.layers} layers x {a.experts} experts, hidden {a.hidden}, expert dim "
          f"{a.expert_dim}, bf16: {count} tensors, {size / 2**20:.1f} MiB; loaded into grouped QKV + stacked "
          f"experts, Shard(0) over {a.ranks} gloo ranks; {a.reps} reps; one expert matrix = "
          f"{expert_slice / 2**10:.0f} KiB; results equal bit for bit: {result['equal']}")
    print("\n".join(table_head("loader", "seconds, slowest rank: best / median",
                               "CPU seconds, busiest rank: best / median",
                               "peak extra memory, worst rank: best / median (MiB)")))
    for name, r in result.items():
        if name == "equal":
            continue
        s, c, m = r["seconds"], r["cpu_seconds"], [x / 2**20 for x in r["extra_bytes"]]
        print(table_row(name, f"{min(s):.2f} / {statistics.median(s):.2f}",
                        f"{min(c):.2f} / {statistics.median(c):.2f}", f"{min(m):.1f} / {statistics.median(m):.1f}"))
    names = [n for n in result if n != "equal"]
    obvious, planner = (result[n]["seconds"] for n in names)
    ratios = [o / p for o, p in zip(obvious, planner, strict=True)]
    print(f"speed-up, obvious / planner: median of the loaders' medians "
          f"{statistics.median(obvious) / statistics.median(planner):.1f}x; per repetition "
          f"{', '.join(f'{r:.1f}x' for r in ratios)}; load average before / after: {load_before} / "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    cpu_obvious, cpu_planner = (statistics.median(result[n]["cpu_seconds"]) for n in names)
    print(f"CPU seconds, obvious / planner (medians): {cpu_obvious / cpu_planner:.1f}x")


if __name__ == "__main__":
    main()
