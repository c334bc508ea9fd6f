"""The CheckpointManager's local tier: what a local save every step costs training, and how
fast a job recovers from it after losing a node, against the durable tier.

Runs ``--world-size`` gloo ranks (4) as ``--nodes`` simulated nodes (2), each node with its
own local directory under ``--shm`` (``/dev/shm`` by default: node-local memory), training an
FSDP2 MLP (``--layers`` x ``--hidden``, Adam) on ``--batch`` samples per rank per step; the
state saved is a ``TrainState`` (model, Adam's moments, step, RNG states).

1. Training (one launch): ``--rounds`` pairs of blocks of ``--block`` steps, one block
   without any checkpoint ("idle") and one with a local save every step, alternating which
   comes first, after one untimed pair that warms both up. A block with saves is timed in
   steady state: an untimed step and save before it put a save in flight, and the
   background work of its last save (which would overlap the next step) is waited for
   after it, untimed; so each timed step carries one save's pause and one save's
   background work. Reported: the time each local save blocks training (median and p90 of
   the slowest rank, split into waiting for the previous save, ``state_dict()`` + flatten,
   and the snapshot copy), the background cost of a save (write, replicate + confirm, CPU
   time), the throughput kept (the median over the pairs of idle time / time with saves:
   other jobs' bursts on a shared machine hit single blocks), and the CPU time per step
   with and without saves. At the end the last step is also saved to the durable tier
   (``--dir`` on disk; with ``--s3`` also to an S3 server on loopback), and both ranks of
   the last node SIGKILL themselves.
2. Recovery (a second launch: the restart): the lost node's local directory is wiped; then
   every rank times ``CheckpointManager(...)`` + ``load()`` from the local tier (the lost
   node's ranks fetch their copies from the other node), and the same state from each
   durable tier by a manager without a local tier (the disk files' pages dropped from the
   page cache first, as on a replacement node), ``--recovery-reps`` times rotating the order;
   the lost node's directory is wiped again before every local recovery. Also timed: a
   recovery with no node lost (a process restart: every copy is local). Every load is
   checked bit for bit against the state saved in phase 1.

Targets (issue 15): throughput kept >= 0.9 with a local save every step; recovery from the
local tier >= 3x faster than from the durable tier for the same state.

Usage::

    python benchmarks/bench_local_tier.py --s3        # about 2 min on a quiet 2-core machine
    python benchmarks/bench_local_tier.py --hidden 256 --batch 32 --rounds 1 --block 2 --recovery-reps 1   # smoke
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.common import cpu_seconds, median_of_slowest, percentile, slowest, write_json  # noqa: E402

# ----------------------------------------------------------------------------- the job


def build(args: argparse.Namespace, seed: int):
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from hyper_parallel import fully_shard

    torch.manual_seed(seed)
    layers = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.hidden, args.hidden), nn.Tanh()]
    model = nn.Sequential(*layers)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def train_step(model, opt, args: argparse.Namespace, step: int, rank: int) -> None:
    import torch

    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(args.batch, args.hidden, generator=g)
    loss = (model(x) - x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def local_snapshot(state) -> dict:
    import torch
    from torch.distributed.tensor import DTensor

    from hyper_parallel.core.distributed_checkpoint._src.state.flatten import flatten

    out = {}
    for key, leaf in flatten(state).leaves.items():
        v = leaf.value
        if isinstance(v, DTensor):
            v = v.to_local()
        out[key] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    return out


def differing(a: dict, b: dict) -> list[str]:
    import torch

    bad = sorted(set(a) ^ set(b))
    for k in set(a) & set(b):
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.shape == y.shape and torch.equal(x, y)):
                bad.append(k)
        elif x != y:
            bad.append(k)
    return bad


def local_bytes(state) -> int:
    import torch

    return sum(v.numel() * v.element_size() for v in local_snapshot(state).values() if isinstance(v, torch.Tensor))


def node_of(rank: int, args: argparse.Namespace) -> int:
    return rank * args.nodes // args.world_size


def manager(args: argparse.Namespace, rank: int, local: bool, durable: str = "disk"):
    """The job's manager: the local tier on top of the disk durable tier, or a manager of
    durable tier ``durable`` alone (what a job without a local tier loads from)."""
    from hyper_parallel.core.distributed_checkpoint import CheckpointManager

    node = node_of(rank, args)
    kwargs = dict(local_dir=os.path.join(args.shm_root, f"node{node}"), node_rank=node, local_keep=2,
                  replicas=2, replication_timeout=120) if local else {}
    where, options = args.durables["disk" if local else durable]
    return CheckpointManager(where, save_interval_steps=10**9, timeout=300, storage_options=options, **kwargs)


def phase_train(rank: int, ws: int, args: argparse.Namespace) -> dict:
    import torch.distributed as dist

    from hyper_parallel.core.distributed_checkpoint import TrainState

    model, opt = build(args, seed=0)
    state = {"app": TrainState(model, opt)}
    step = 0
    for _ in range(3):  # warm-up
        step += 1
        train_step(model, opt, args, step, rank)
    mgr = manager(args, rank, local=True)
    step += 1
    train_step(model, opt, args, step, rank)
    state["app"].step = step
    mgr.save(step, state)  # a first local save: buffers, threads, the replication group
    mgr.local_tier.wait()
    first_saved = len(mgr.local_tier.timings)
    idle, with_saves, cpu_idle, cpu_saves = [], [], [], []
    for rnd in range(-1, args.rounds):  # short alternating blocks: drifting machine load hits both alike
        for kind in ("idle", "local") if rnd % 2 == 0 else ("local", "idle"):
            if kind == "local":  # steady state: a save is in flight when the block starts ...
                step += 1
                train_step(model, opt, args, step, rank)
                state["app"].step = step
                mgr.save(step, state)
            dist.barrier()
            t0, c0 = time.perf_counter(), cpu_seconds()
            for _ in range(args.block):
                step += 1
                train_step(model, opt, args, step, rank)
                if kind == "local":
                    state["app"].step = step
                    mgr.save(step, state)
            c1 = cpu_seconds()
            dist.barrier()
            if rnd >= 0:  # round -1 warms both kinds up
                (idle if kind == "idle" else with_saves).append(time.perf_counter() - t0)
                (cpu_idle if kind == "idle" else cpu_saves).append(c1 - c0)
            if kind == "local":  # ... and the one started last overlaps the next block's first step, untimed
                mgr.local_tier.wait()
    timings = list(mgr.local_tier.timings)[first_saved + args.block + 1:]  # after the warm-up round
    state["app"].step = step
    mgr.save(step, state, force=True)  # the same step in the durable tier (the local save of it exists)
    mgr.wait()
    for name in args.durables:
        if name != "disk":
            with manager(args, rank, local=False, durable=name) as other:
                other.save(step, state, force=True)
    nbytes = local_bytes(state)
    import torch

    torch.save(local_snapshot(state), os.path.join(args.work, f"expected-r{rank}.pt"))
    confirmed = all(t.confirmed for t in timings)
    mgr.close()
    return {"idle": idle, "local": with_saves, "cpu_idle": cpu_idle, "cpu_local": cpu_saves, "step": step,
            "bytes": nbytes, "confirmed": confirmed,
            **{f: [getattr(t, f"{f}_s") for t in timings]
               for f in ("blocking", "waited", "state_dict", "snapshot", "write", "replicate", "cpu")}}


def phase_recover(rank: int, ws: int, args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    from benchmarks.dcp_common import drop_page_cache
    from hyper_parallel.core.distributed_checkpoint import TrainState

    model, opt = build(args, seed=1)
    state = {"app": TrainState(model, opt)}
    train_step(model, opt, args, 10**6, rank)  # optimizer state exists, with other values
    expected = torch.load(os.path.join(args.work, f"expected-r{rank}.pt"), weights_only=False)
    lost = [r for r in range(ws) if node_of(r, args) == args.nodes - 1]
    kinds = ["local", *args.durables, "restart"]  # rep 0 starts with the node loss the parent staged
    out: dict[str, list] = {k: [] for kind in kinds for k in (kind, f"{kind}_open")}
    out.update(fetched=[], source=[], wrong=[])
    for rep in range(args.recovery_reps):
        order = kinds[rep % len(kinds):] + kinds[:rep % len(kinds)]
        for kind in order:
            dist.barrier()
            if kind == "local" and rep and rank == lost[0]:  # the node is lost again
                shutil.rmtree(os.path.join(args.shm_root, f"node{args.nodes - 1}"), ignore_errors=True)
            if kind == "disk" and rank == 0:  # a replacement node has none of it in its page cache
                drop_page_cache([args.durables["disk"][0]], method="fadvise")
            dist.barrier()
            t0 = time.perf_counter()
            mgr = manager(args, rank, local=kind in ("local", "restart"), durable=kind)
            t1 = time.perf_counter()
            step = mgr.load(state)
            t2 = time.perf_counter()
            if kind in ("local", "restart"):
                rec = mgr.local_tier.last_recovery
                out["fetched"].append(rec.bytes_fetched)
                out["source"].append(rec.source)
                out.setdefault("phases", []).append(rec.phases)
            mgr.close()
            out[kind].append(t2 - t0)
            out[f"{kind}_open"].append(t1 - t0)
            wrong = differing(local_snapshot(state), expected)
            out["wrong"].append(f"{kind}: step {step}, {len(wrong)} keys differ {wrong[:3]}" if wrong else "")
            train_step(model, opt, args, 10**6 + rep, rank)  # the next load must restore everything again
    return out


# ----------------------------------------------------------------------------- processes


def _worker(rank: int, ws: int, init_file: str, phase: str, args: argparse.Namespace, q) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    warnings.filterwarnings("ignore")
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ws,
                                timeout=timedelta(seconds=600))
        result = (phase_train if phase == "train" else phase_recover)(rank, ws, args)
        q.put((rank, "ok", result))
        if phase == "train" and node_of(rank, args) == args.nodes - 1:
            os.kill(os.getpid(), signal.SIGKILL)  # the last node is lost
        dist.destroy_process_group()
    except BaseException:
        q.put((rank, "err", traceback.format_exc()))


def launch(phase: str, args: argparse.Namespace) -> list[dict]:
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    store = tempfile.mkdtemp(prefix="bench_local_store_")
    procs = [ctx.Process(target=_worker, args=(r, args.world_size, os.path.join(store, "s"), phase, args, q))
             for r in range(args.world_size)]
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    try:
        while len(results) < args.world_size:
            rank, kind, payload = q.get()
            if kind != "ok":
                raise RuntimeError(f"{phase}: rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
        shutil.rmtree(store, ignore_errors=True)
    return [results[r] for r in range(args.world_size)]


# ----------------------------------------------------------------------------- report


def start_s3() -> tuple[object, str, dict]:
    """An S3-compatible server on loopback (moto, as the tests use) and a fresh bucket."""
    import uuid

    import boto3
    from moto.server import ThreadedMotoServer

    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    bucket = f"hp-bench-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1").create_bucket(Bucket=bucket)
    options = {"key": "testing", "secret": "testing",
               "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    return server, f"s3://{bucket}/run", options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=512, help="samples per rank per step")
    parser.add_argument("--block", type=int, default=2, help="steps per measured block")
    parser.add_argument("--rounds", type=int, default=10, help="(idle block, block with saves) pairs, alternated")
    parser.add_argument("--recovery-reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--shm", default="/dev/shm", help="where the nodes' local directories go")
    parser.add_argument("--dir", default=None, help="where the disk durable tier goes (default: a temp dir)")
    parser.add_argument("--s3", action="store_true",
                        help="also save the final step to an S3 server on loopback (moto) and time loading it")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()

    args.shm_root = tempfile.mkdtemp(prefix="hp-local-bench-", dir=args.shm)
    args.work = tempfile.mkdtemp(prefix="hp-local-bench-", dir=args.dir)
    args.durables = {"disk": (os.path.join(args.work, "durable"), None)}
    server = None
    try:
        if args.s3:
            server, url, options = start_s3()
            args.durables["s3"] = (url, options)
        started = time.time()
        args.load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
        train = launch("train", args)
        shutil.rmtree(os.path.join(args.shm_root, f"node{args.nodes - 1}"))  # the lost node's memory
        recover = launch("recover", args)
        elapsed = time.time() - started
    finally:
        shutil.rmtree(args.shm_root, ignore_errors=True)
        shutil.rmtree(args.work, ignore_errors=True)
        if server is not None:
            server.stop()

    idle = [max(r["idle"][i] for r in train) for i in range(args.rounds)]
    busy = [max(r["local"][i] for r in train) for i in range(args.rounds)]
    kept_sum = sum(idle) / sum(busy)
    kept = statistics.median(i / b for i, b in zip(idle, busy, strict=True))  # robust to other jobs' bursts
    cpu_kept = sum(sum(r["cpu_idle"]) for r in train) / sum(sum(r["cpu_local"]) for r in train)
    blocking = slowest([r["blocking"] for r in train])
    per_rank = train[0]["bytes"]
    total = sum(r["bytes"] for r in train)
    wrong = [w for r in recover for w in r["wrong"] if w]
    sources = {s for r in recover for s in r["source"]}
    step_s = sum(idle) / (args.rounds * args.block)
    names = list(recover[0]["phases"][0])
    lost = [i for i, f in enumerate(recover[-1]["fetched"]) if f]  # the local recoveries after a node loss
    figures = {
        "state_bytes": total, "state_bytes_per_rank": per_rank, "step_s_idle": step_s,
        "blocking_median_s": statistics.median(blocking), "blocking_p90_s": percentile(blocking, 0.9),
        **{f"{k}_median_s": median_of_slowest([r[k] for r in train])
           for k in ("waited", "state_dict", "snapshot", "write", "replicate", "cpu")},
        "throughput_kept": kept, "throughput_kept_sum": kept_sum, "cpu_kept": cpu_kept,
        "idle_blocks_s": idle, "save_blocks_s": busy,
        "recovery_local_phases_s": {n: statistics.median(max(r["phases"][i][n] for r in recover) for i in lost)
                                    for n in names},
        "fetched_bytes_lost_node": max(max(r["fetched"]) for r in recover), "sources": sorted(sources),
        "all_confirmed": all(r["confirmed"] for r in train), "wrong": wrong, "wall_s": elapsed,
    }
    for kind in ["local", "restart", *args.durables]:
        figures[f"recovery_{kind}_s"] = slowest([r[kind] for r in recover])
        figures[f"recovery_{kind}_median_s"] = statistics.median(figures[f"recovery_{kind}_s"])
        figures[f"start_{kind}_median_s"] = median_of_slowest([r[f"{kind}_open"] for r in recover])
    speedups = {k: figures[f"recovery_{k}_median_s"] / figures["recovery_local_median_s"] for k in args.durables}
    figures["speedups"] = speedups

    mb = 1 << 20
    ms = 1e3
    print(f"state: {total / mb:.1f} MiB ({per_rank / mb:.1f} MiB per rank: FSDP2 MLP {args.layers}x{args.hidden} + "
          f"Adam, in a TrainState), {args.world_size} ranks as {args.nodes} nodes, local directories in {args.shm}; "
          f"idle step {step_s * ms:.0f} ms ({args.batch} samples per rank)")
    print(f"local save every step ({len(blocking)} saves, every one confirmed: {figures['all_confirmed']}); "
          "medians of the slowest rank:")
    print(f"  training blocked per save       {figures['blocking_median_s'] * ms:7.1f} ms (p90 "
          f"{figures['blocking_p90_s'] * ms:.1f}): waiting for the previous save {figures['waited_median_s'] * ms:.1f}"
          f", state_dict() + flatten {figures['state_dict_median_s'] * ms:.1f}, snapshot copy "
          f"{figures['snapshot_median_s'] * ms:.1f}")
    print(f"  in the background               write {figures['write_median_s'] * ms:.1f} ms, replicate + confirm "
          f"{figures['replicate_median_s'] * ms:.1f} ms, CPU {figures['cpu_median_s'] * ms:.1f} ms")
    print(f"  throughput kept                 {kept:.3f}   (median over {args.rounds} pairs of {args.block}-step "
          f"blocks of idle time / time with saves; over their sums {kept_sum:.3f})")
    print(f"    idle blocks {[round(x, 2) for x in idle]} s")
    print(f"    with saves  {[round(x, 2) for x in busy]} s")
    print(f"  CPU time per step, idle / with saves   {cpu_kept:.3f}   (all ranks, all threads: what the saves "
          "cost when the CPUs are the bottleneck)")
    print(f"recovery after losing node {args.nodes - 1} (slowest rank, manager start + load, medians of "
          f"{args.recovery_reps}):")
    print(f"  from the local tier             {figures['recovery_local_median_s'] * ms:7.1f} ms  "
          f"{[round(x * ms) for x in figures['recovery_local_s']]} (start {figures['start_local_median_s'] * ms:.0f}"
          f" ms; {figures['fetched_bytes_lost_node'] / mb:.1f} MiB fetched by each rank of the lost node)")
    phases = figures["recovery_local_phases_s"].items()
    print("    load() steps: " + ", ".join(f"{n} {v * ms:.0f} ms" for n, v in phases))
    print(f"  from the local tier, no node lost  {figures['recovery_restart_median_s'] * ms:7.1f} ms  "
          f"{[round(x * ms) for x in figures['recovery_restart_s']]} (a process restart: each rank reads its own copy)")
    label = {"disk": "durable tier on disk (cold)", "s3": "durable tier on S3 (moto, loopback)"}
    for kind in args.durables:
        print(f"  from the {label[kind]:<30} {figures[f'recovery_{kind}_median_s'] * ms:7.1f} ms  "
              f"{[round(x * ms) for x in figures[f'recovery_{kind}_s']]} (start "
              f"{figures[f'start_{kind}_median_s'] * ms:.0f} ms): local is {speedups[kind]:.2f}x faster")
    print(f"  every load bit-exact: {not wrong}; local recoveries came from: {sorted(sources)}")
    print("targets:")
    targets = [("throughput kept >= 0.9 with a local save every step", kept >= 0.9, f"{kept:.3f}")]
    targets += [(f"recovery from the local tier >= 3x faster than {label[k]}", v >= 3.0, f"{v:.2f}x")
                for k, v in speedups.items()]
    for name, met, value in targets:
        print(f"  {name:<72} {value:>8}: {'met' if met else 'NOT met'}")
    if wrong:
        print("WRONG LOADS:", wrong)
    print(f"(wall time {elapsed:.0f} s; load average before: {args.load_before})")
    if args.json:
        write_json(args.json, {"args": {k: v for k, v in vars(args).items() if k != "durables"}, "figures": figures})
    if wrong or sources != {"local"}:
        sys.exit(1)


if __name__ == "__main__":
    main()
