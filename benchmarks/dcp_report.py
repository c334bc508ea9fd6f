"""Turn the DCP benchmark's raw records into results: statistics, targets, markdown, a chart."""

from __future__ import annotations

import math
import statistics
from typing import Any

from benchmarks.common import summary, table_head, target_line
from benchmarks.dcp_common import GiB, MiB, human_bytes

# scenario -> (title, raw-limit key it is compared with)
LOADS = {
    "load_same": ("load, same layout (cold)", "read_cold"),
    "load_reshard_s0_s1": ("load resharded Shard(0)->Shard(1) (cold)", "read_cold"),
    "load_reshard_2n_n": ("load resharded {n2} ranks -> {n} (cold)", "read_cold"),
    "load_n_1": ("load {n} ranks -> 1 process, no_dist (cold)", "read_cold"),
}
LIMITS = {
    "write": "sequential write, no fsync",
    "write_fsync": "sequential write + fsync",
    "read_cold": "sequential read (readinto), cold cache",
    "read_warm": "sequential read (readinto), warm cache",
    "write_direct": "sequential write, O_DIRECT + fsync (page-aligned buffer)",
    "read_direct": "sequential read, O_DIRECT (cold)",
    "memcpy_fresh": "memcpy into fresh memory",
    "memcpy_reused": "memcpy into reused memory",
    "crc32c": "crc32c of the same bytes (1 MiB pieces)",
}
REFERENCES = {
    "torch_save": "torch.save + fsync (1 process, whole state)",
    "safetensors_save": "safetensors save_file + fsync (1 process)",
    "torch_load": "torch.load (1 process, cold)",
    "safetensors_load": "safetensors load_file (1 process, cold)",
}


# ---------------------------------------------------------------------------- merging ranks


def merge_ranks(per_rank: list[dict]) -> dict[str, dict[str, list[dict]]]:
    """Combine every rank's records rep by rep: one wall time, summed byte counters."""
    merged: dict[str, dict[str, list[dict]]] = {}
    first = per_rank[0]["records"]
    for scenario, variants in first.items():
        for variant, reps in variants.items():
            out = []
            for i, rec in enumerate(reps):
                same = [r["records"].get(scenario, {}).get(variant, [])[i] for r in per_rank
                        if i < len(r["records"].get(scenario, {}).get(variant, []))]
                m = dict(rec)
                for k in ("bytes_read", "rchar", "disk_read", "disk_write", "cpu_s"):
                    if any(k in s for s in same):
                        m[k] = sum(s.get(k, 0) for s in same)
                if "correct" in rec:
                    m["correct"] = all(s.get("correct", True) for s in same)
                for k in ("blocking_s", "committed_s", "rank_s", "call_s", "state_dict_s"):
                    if k in rec:
                        m[k] = max(s[k] for s in same)
                for k in ("kept", "background_cpu_s", "lost_s"):  # the mean over ranks
                    if k in rec:
                        vals = [s[k] for s in same if s.get(k) is not None]
                        m[k] = sum(vals) / len(vals) if vals else None
                if variant == "_error":
                    m["errors"] = sorted({s.get("error", "") for s in same})
                out.append(m)
            merged.setdefault(scenario, {})[variant] = out
    for r in per_rank[1:]:  # errors seen only on other ranks
        for scenario, variants in r["records"].items():
            if "_error" in variants and "_error" not in merged.get(scenario, {}):
                merged.setdefault(scenario, {})["_error"] = variants["_error"]
    return merged


# ---------------------------------------------------------------------------- results


def _rate(nbytes: int, reps: list[dict]) -> dict:
    return summary([nbytes / r["wall_s"] / GiB for r in reps if r.get("wall_s")])


def _secs(reps: list[dict], key: str = "wall_s") -> dict:
    return summary([r[key] for r in reps if r.get(key) is not None])


def _cpu(nbytes: int, reps: list[dict]) -> dict:
    """CPU seconds (all ranks, all threads) per GiB of the global state."""
    return summary([r["cpu_s"] / (nbytes / GiB) for r in reps if r.get("cpu_s") is not None])


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return None
    return a / b


# what the paired limit (variant "raw", measured in the same repetitions) does, by limit
PAIRED = {"write_fsync": "write + fsync of the same bytes, same reps",
          "read_cold": "readinto of the same files, same reps"}
DIRECT = {"write_fsync": "write_direct", "read_cold": "read_direct"}  # buffered limit -> its O_DIRECT twin


def build_results(merged: dict, total: int, ws: int, local_bytes: list[int], model_bytes: int | None = None) -> dict:
    """Statistics per scenario from the merged records (GiB/s of the global state)."""
    res: dict[str, Any] = {}
    lim = merged.get("limits", {})
    res["limits"] = {}
    for key in LIMITS:
        if key in lim:
            entry = {"GiBps": _rate(total, lim[key]), "seconds": _secs(lim[key]),
                     "cpu_s_per_GiB": _cpu(total, lim[key])}
            if key == "read_cold":
                entry["resident_before"] = [r.get("resident_before") for r in lim[key]]
                entry["cold_method"] = lim[key][0].get("cold_method")
            res["limits"][key] = entry
    if "_error" in lim:
        res["limits"]["error"] = lim["_error"][0].get("errors") or lim["_error"][0].get("error")
    limit_of = {k: v["GiBps"]["median"] for k, v in res["limits"].items() if isinstance(v, dict)}

    sc: dict[str, Any] = {}
    save = merged.get("sync_save", {})
    sc["sync_save"] = _throughput("sync save (fsync)", save, total, limit_of.get("write_fsync"), "write_fsync")
    for key, (title, limit_key) in LOADS.items():
        title = title.format(n=ws, n2=2 * ws)
        data = merged.get(key, {})
        entry = _throughput(title, data, total, limit_of.get(limit_key), limit_key)
        entry["bytes"] = {v: _bytes(reps, total) for v, reps in data.items() if v != "_error"}
        entry["correct"] = {v: all(r.get("correct", True) for r in reps) for v, reps in data.items() if v != "_error"}
        entry["resident_before"] = sorted({r.get("resident_before") for reps in data.values() for r in reps
                                           if r.get("resident_before") is not None})
        sc[key] = entry
    ref = merged.get("reference", {})
    sc["reference"] = {"title": "single-process references (whole state in 1 process)",
                       "variants": {k: {"title": t, "GiBps": _rate(total, ref[k]), "seconds": _secs(ref[k]),
                                        "cpu_s_per_GiB": _cpu(total, ref[k])}
                                    for k, t in REFERENCES.items() if k in ref}}
    if "_error" in ref:
        sc["reference"]["error"] = ref["_error"][0].get("errors")
    sc["async_save"] = _async(merged.get("async_save", {}), res["limits"], sc["sync_save"], local_bytes)
    for key in ("sync_save", *LOADS):
        direct = limit_of.get(DIRECT[sc[key]["limit"]])
        ours = sc[key]["variants"].get("ours", {}).get("GiBps", {}).get("median")
        sc[key]["direct_limit_GiBps"] = direct
        sc[key]["ours_vs_direct"] = _ratio(ours, direct)
    res["scenarios"] = sc
    if model_bytes and (merged.get("model_save") or merged.get("model_load")):
        res["model"] = {"bytes": model_bytes}
        for key, title, limit_key in (("model_save", "FSDP2 + AdamW save (get_state_dict + save)", "write_fsync"),
                                      ("model_load", "FSDP2 + AdamW load (cold; get_state_dict + load + "
                                                     "set_state_dict)", "read_cold")):
            data = merged.get(key, {})
            entry = _throughput(title, data, model_bytes, limit_of.get(limit_key), limit_key)
            calls = {v: _secs(reps, "call_s") for v, reps in data.items() if v != "_error"}
            entry["call_s"] = calls
            entry["call_ours_vs_torch"] = _ratio(calls.get("torch", {}).get("median"),
                                                 calls.get("ours", {}).get("median"))
            entry["correct"] = {v: all(r.get("correct", True) for r in reps) for v, reps in data.items()
                                if v not in ("_error", "raw")}
            res["model"][key] = entry
    return res


def hsdp_results(per_rank: list[dict], total: int, limits: dict) -> dict:
    """The replicated (HSDP) load: wall times, and bytes read per rank and in total, next to
    the size of each library's checkpoint (its data files)."""
    merged = merge_ranks(per_rank)
    ws = len(per_rank)
    read_limit = limits.get("read_cold", {}).get("GiBps", {}).get("median")
    out: dict[str, Any] = {"world_size": ws, "mesh": [2, ws // 2], "bytes": total,
                           "checkpoint_bytes": per_rank[0]["checkpoint_bytes"]}
    out["save"] = _throughput("HSDP save", merged.get("hsdp_save", {}), total, None, "write_fsync")
    out["load"] = _throughput(f"HSDP load, 2 replicas x {ws // 2} shards (cold)", merged.get("hsdp_load", {}), total,
                              read_limit, "read_cold")
    per: dict[str, Any] = {}
    for lib in ("ours", "ours_noshare", "torch"):
        rows = []
        for r, pr in enumerate(per_rank):
            reps = pr["records"].get("hsdp_load", {}).get(lib, [])
            if reps:
                rec = reps[0]
                rows.append({"rank": r, "reader_bytes_read": rec.get("bytes_read"), "syscall_read": rec.get("rchar"),
                             "storage_read": rec.get("disk_read")})
        if not rows:
            continue
        ckpt = out["checkpoint_bytes"].get("torch" if lib == "torch" else "ours") or 0
        tot = {k: sum(x.get(k) or 0 for x in rows) for k in ("reader_bytes_read", "syscall_read", "storage_read")}
        # what the library asked of storage: ours' reader counter, torch's read syscalls
        asked = tot["syscall_read"] if lib == "torch" else tot["reader_bytes_read"]
        per[lib] = {"per_rank": rows, "total": tot, "asked_over_checkpoint": _ratio(asked, ckpt),
                    "storage_over_checkpoint": _ratio(tot["storage_read"], ckpt),
                    "correct": all(r.get("correct", True) for r in merged.get("hsdp_load", {}).get(lib, []))}
    out["reads"] = per
    return out


def _throughput(title: str, data: dict, total: int, limit: float | None, limit_key: str) -> dict:
    entry: dict[str, Any] = {"title": title, "limit": limit_key, "limit_GiBps": limit, "variants": {}}
    for variant, reps in data.items():
        if variant == "_error":
            entry["error"] = reps[0].get("errors") or reps[0].get("error")
            continue
        entry["variants"][variant] = {"GiBps": _rate(total, reps), "seconds": _secs(reps),
                                      "cpu_s_per_GiB": _cpu(total, reps)}
    ours = entry["variants"].get("ours", {}).get("GiBps", {}).get("median")
    theirs = entry["variants"].get("torch", {}).get("GiBps", {}).get("median")
    entry["ours_vs_torch"] = _ratio(ours, theirs)
    entry["ours_vs_limit"] = _ratio(ours, limit)
    entry["torch_vs_limit"] = _ratio(theirs, limit)
    nov = entry["variants"].get("ours_noverify", {}).get("GiBps", {}).get("median")
    if nov is not None:
        entry["ours_noverify_vs_torch"] = _ratio(nov, theirs)
        entry["ours_noverify_vs_limit"] = _ratio(nov, limit)
    # the paired limit: plain writes of the same bytes (saves) or plain reads of the same
    # files (loads), in the same repetitions
    raw = entry["variants"].get("raw", {}).get("GiBps", {}).get("median")
    if raw is not None:
        entry["paired_limit_GiBps"] = raw
        entry["ours_vs_paired"] = _ratio(ours, raw)  # (torch reads files of its own: no pair)
        if nov is not None:
            entry["ours_noverify_vs_paired"] = _ratio(nov, raw)
        # the same ratio taken within each repetition (the readers ran back to back there), median
        pairs = [r["wall_s"] / o["wall_s"] for r, o in zip(data.get("raw", []), data.get("ours", []), strict=False)
                 if r.get("wall_s") and o.get("wall_s")]
        entry["ours_vs_paired_reps"] = statistics.median(pairs) if pairs else None
        raw_cpu = entry["variants"]["raw"]["cpu_s_per_GiB"]["median"]
        for v in ("ours", "ours_noverify", "torch"):
            cpu = entry["variants"].get(v, {}).get("cpu_s_per_GiB", {}).get("median")
            if cpu is not None:
                entry[f"{v}_cpu_vs_paired"] = _ratio(cpu, raw_cpu)
    return entry


def _vs_read_limit(s: dict) -> tuple[float | None, str]:
    """A load's ratio to its read limit: the paired one (the same files, the same
    repetitions) where measured, else the one measured at the start on fresh files."""
    fresh = f"limit at the start, fresh files {_f(s.get('limit_GiBps'))} GiB/s"
    if s.get("paired_limit_GiBps") is not None:
        return s.get("ours_vs_paired"), (f"readinto of the same files, same reps {_f(s['paired_limit_GiBps'])} GiB/s "
                                         f"({fresh}: {_f(s.get('ours_vs_limit'))}x)")
    return s.get("ours_vs_limit"), fresh


def _bytes(reps: list[dict], needed: int) -> dict:
    r = reps[0]
    out = {"needed": needed, "syscall_read": r.get("rchar"), "storage_read": r.get("disk_read")}
    if "bytes_read" in r:
        out["reader_bytes_read"] = r["bytes_read"]
    read = r.get("bytes_read", r.get("rchar"))
    out["read_over_needed"] = _ratio(read, needed)
    return out


def _async(data: dict, limits: dict, sync_save: dict, local_bytes: list[int]) -> dict:
    entry: dict[str, Any] = {"title": "async save, compute loop running", "variants": {}}
    if "_error" in data:
        entry["error"] = data["_error"][0].get("errors") or data["_error"][0].get("error")
    for variant, reps in data.items():
        if variant == "_error":
            continue
        entry["variants"][variant] = {
            "blocking_s": _secs(reps, "blocking_s"), "committed_s": _secs(reps, "committed_s"),
            "kept": summary([r["kept"] for r in reps if r.get("kept") is not None]),
            "background_cpu_s": _secs(reps, "background_cpu_s"),
            "lost_s": _secs(reps, "lost_s"),
        }
    entry["available"] = "ours" in entry["variants"]
    memcpy = limits.get("memcpy_reused", {}).get("seconds", {}).get("median")
    entry["memcpy_reused_s"] = memcpy
    entry["local_bytes_per_rank"] = max(local_bytes) if local_bytes else None
    ours = entry["variants"].get("ours", {})
    torch_ = entry["variants"].get("torch", {})
    ob = ours.get("blocking_s", {}).get("median")
    entry["blocking_vs_memcpy"] = _ratio(ob, memcpy)
    entry["blocking_vs_torch"] = _ratio(ob, torch_.get("blocking_s", {}).get("median"))
    sync_s = sync_save.get("variants", {}).get("ours", {}).get("seconds", {}).get("median")
    entry["ours_sync_save_s"] = sync_s
    entry["committed_vs_sync"] = _ratio(ours.get("committed_s", {}).get("median"), sync_s)
    entry["torch_committed_vs_sync"] = _ratio(torch_.get("committed_s", {}).get("median"), sync_s)
    return entry


# ---------------------------------------------------------------------------- targets


def targets(res: dict, baseline: dict | None = None) -> list[dict]:
    """Each target: met (True/False), or None when it could not be measured.

    ``issue`` says whose target it is: ``33`` (CPU per GiB), ``13`` (I/O engine), ``12`` (scale), ``"r1"`` (the
    release-1 targets this benchmark was first written for). ``baseline`` is a previous
    run's JSON (``benchmarks/results/baseline_v1.json``) for targets relative to today.
    """
    sc = res["scenarios"]
    out: list[dict] = []
    issue: list[Any] = ["r1"]

    def add(name: str, value: float | None, op: str, bound: float, what: str, extra: str = "") -> None:
        met = None if value is None or (isinstance(value, float) and math.isnan(value)) else (
            value >= bound if op == ">=" else value <= bound if op == "<=" else value < bound)
        shown = "n/a" if value is None else f"{value:.2f}"
        out.append({"issue": issue[0], "target": name, "value": value, "op": op, "bound": bound, "met": met,
                    "detail": f"{what} = {shown} (needs {op} {bound:g}){extra}"})

    def med(entry: dict, variant: str, key: str = "GiBps") -> float | None:
        return entry.get("variants", {}).get(variant, {}).get(key, {}).get("median")

    # ---- release 1
    s = sc["sync_save"]
    fig = f"; ours {_f(med(s, 'ours'))}, torch {_f(med(s, 'torch'))}, limit {_f(s.get('limit_GiBps'))} GiB/s"
    add("save >= 1.5x torch DCP", s.get("ours_vs_torch"), ">=", 1.5, "ours/torch", fig)
    add("save >= 0.9x raw write+fsync", s.get("ours_vs_limit"), ">=", 0.9, "ours/limit", fig)
    s = sc["load_same"]
    ratio, limit = _vs_read_limit(s)
    add("same-layout load >= 0.9x raw read (cold)", ratio, ">=", 0.9, "ours/limit",
        f"; ours {_f(med(s, 'ours'))}, torch {_f(med(s, 'torch'))} GiB/s, {limit}")
    for key in ("load_reshard_s0_s1", "load_reshard_2n_n", "load_n_1"):
        s = sc[key]
        tag = s["title"].replace(" (cold)", "")
        ratio, limit = _vs_read_limit(s)
        fig = f"; ours {_f(med(s, 'ours'))}, torch {_f(med(s, 'torch'))} GiB/s, {limit}"
        also = "" if key == "load_reshard_s0_s1" else " [also]"
        add(f"{tag} >= 0.8x raw read{also}", ratio, ">=", 0.8, "ours/limit", fig)
        add(f"{tag} >= 1.75x torch DCP{also}", s.get("ours_vs_torch"), ">=", 1.75, "ours/torch", fig)
    a = sc["async_save"]
    ob = a.get("variants", {}).get("ours", {}).get("blocking_s", {}).get("median")
    tb = a.get("variants", {}).get("torch", {}).get("blocking_s", {}).get("median")
    add("async blocking <= 0.5x torch DCP's", a.get("blocking_vs_torch"), "<=", 0.5, "ours/torch",
        f"; ours {_f(ob, 's', 3)}, torch {_f(tb, 's', 3)}")

    # ---- issue 13: the I/O engine, on the 26-tensor and the many-tensor state dicts alike
    issue[0] = 13
    sets = [(f"{res.get('tensors', '?')} tensors", res)]
    if res.get("many"):
        sets.append((f"{res['many'].get('tensors', '?')} tensors", res["many"]))
    for label, r in sets:
        s = r["scenarios"]["sync_save"]
        fig = (f"; ours {_f(med(s, 'ours'))}, write+fsync {_f(s.get('limit_GiBps'))}, O_DIRECT "
               f"{_f(s.get('direct_limit_GiBps'))} GiB/s")
        add(f"[{label}] save >= 1.0x buffered write+fsync limit", s.get("ours_vs_limit"), ">=", 1.0,
            "ours/limit", fig)
        add(f"[{label}] save >= 0.8x O_DIRECT write limit", s.get("ours_vs_direct"), ">=", 0.8, "ours/O_DIRECT", fig)
        s = r["scenarios"]["load_same"]
        ratio, limit = _vs_read_limit(s)
        add(f"[{label}] cold load >= 0.95x buffered readinto limit", ratio, ">=", 0.95,
            "ours/limit", f"; ours {_f(med(s, 'ours'))} GiB/s, {limit}")
        s = r["scenarios"]["load_reshard_s0_s1"]
        ratio, limit = _vs_read_limit(s)
        add(f"[{label}] Shard(0)->Shard(1) cold load >= 0.9x readinto limit", ratio, ">=", 0.9,
            "ours/limit", f"; ours {_f(med(s, 'ours'))} GiB/s, {limit}")
    m = res.get("model") or {}
    for key, word in (("model_save", "save"), ("model_load", "load")):
        e = m.get(key) or {}
        calls = e.get("call_s", {})
        add(f"FSDP2 + AdamW model {word} >= 1.5x torch DCP", e.get("ours_vs_torch"), ">=", 1.5, "torch s/ours s",
            f"; ours {_f(med(e, 'ours', 'seconds'), 's', 3)}, torch {_f(med(e, 'torch', 'seconds'), 's', 3)} "
            f"(library call alone: ours {_f(calls.get('ours', {}).get('median'), 's', 3)}, torch "
            f"{_f(calls.get('torch', {}).get('median'), 's', 3)}, {_f(e.get('call_ours_vs_torch'))}x)")
    h = res.get("hsdp") or {}
    rd = (h.get("reads") or {}).get("ours", {})
    add("replicated load (2 replicas x 2 shards): bytes read <= 1.05x checkpoint", rd.get("asked_over_checkpoint"),
        "<=", 1.05, "read/checkpoint",
        f"; ours' reader read {human_bytes((rd.get('total') or {}).get('reader_bytes_read') or 0)} of a "
        f"{human_bytes((h.get('checkpoint_bytes') or {}).get('ours') or 0)} checkpoint")
    now = (h.get("load") or {}).get("variants", {}).get("ours", {}).get("seconds", {}).get("median")
    then, why = _baseline_hsdp(baseline, res, h)
    add("replicated load wall <= 1.2x the v1 baseline", _ratio(now, then), "<=", 1.2, "now/baseline",
        f"; now {_f(now, 's', 3)}, baseline {_f(then, 's', 3)}{why}")
    alone = (h.get("load") or {}).get("variants", {}).get("ours_noshare", {}).get("seconds", {}).get("median")
    add("replicated load wall <= 1.2x every replica reading for itself (same run)", _ratio(now, alone), "<=", 1.2,
        "shared/alone", f"; shared reads {_f(now, 's', 3)}, alone {_f(alone, 's', 3)}")
    a = sc["async_save"]
    oc = a.get("variants", {}).get("ours", {}).get("committed_s", {}).get("median")
    add("async committed <= 1.2x our sync save", a.get("committed_vs_sync"), "<=", 1.2, "committed/sync",
        f"; committed after {_f(oc, 's', 3)}, sync save {_f(a.get('ours_sync_save_s'), 's', 3)}")
    kept = a.get("variants", {}).get("ours", {}).get("kept", {}).get("median")
    tk = a.get("variants", {}).get("torch", {}).get("kept", {}).get("median")
    add("async: training throughput kept >= 0.85", kept, ">=", 0.85, "kept", f"; torch DCP keeps {_f(tk, '', 2)}")
    add("async blocking <= 1.2x one memcpy into reused memory", a.get("blocking_vs_memcpy"), "<=", 1.2,
        "blocking/memcpy", f"; ours blocks {_f(ob, 's', 3)}, memcpy of "
        f"{human_bytes(a.get('local_bytes_per_rank') or 0)}/rank {_f(a.get('memcpy_reused_s'), 's', 3)}")

    # ---- issue 33: CPU per GiB against the paired limit (the same bytes written or read
    #      plainly in the same repetitions), on the 26-tensor and the many-tensor state dicts
    issue[0] = 33
    for label, r in sets:
        for key, word, raw in (("sync_save", "save", "write+fsync"), ("load_same", "same-layout load", "readinto"),
                               ("load_reshard_s0_s1", "Shard(0)->Shard(1) load", "readinto")):
            s = r["scenarios"][key]
            oc = med(s, "ours", "cpu_s_per_GiB")
            rc = med(s, "raw", "cpu_s_per_GiB")
            add(f"[{label}] {word} CPU/GiB <= 1.3x raw {raw}'s", s.get("ours_cpu_vs_paired"), "<=", 1.3,
                "ours/raw CPU", f"; ours {_f(oc, 's/GiB')}, raw {_f(rc, 's/GiB')}, torch DCP "
                f"{_f(med(s, 'torch', 'cpu_s_per_GiB'), 's/GiB')}")
            add(f"[{label}] {word} wall >= 0.95x the paired limit", s.get("ours_vs_paired"), ">=", 0.95,
                "ours/raw GiB/s", f"; ours {_f(med(s, 'ours'))}, raw {_f(s.get('paired_limit_GiBps'))} GiB/s")
    # the async save (512 MiB per rank here): its background CPU per GiB of state, and the
    # compute a training loop loses per save against torch DCP's in the same run
    bg = med(a, "ours", "background_cpu_s")
    per_rank = a.get("local_bytes_per_rank")
    bg_gib = bg / (per_rank / (1 << 30)) if bg is not None and per_rank else None
    # this machine's floor for that background: the checksum pass and the O_DIRECT write+fsync
    # of the same bytes, each measured alone (64 MiB writes; the writer's are 8 MiB)
    floor_parts = [res["limits"].get(k, {}).get("cpu_s_per_GiB", {}).get("median") for k in ("crc32c", "write_direct")]
    floor = sum(floor_parts) if None not in floor_parts else None
    add("async: background CPU per GiB <= 0.12 s", bg_gib, "<=", 0.12, "CPU s/GiB",
        f"; {_f(bg, 's', 3)} per rank of {human_bytes(per_rank or 0)}; this machine's floor (crc32c "
        f"{_f(floor_parts[0], '', 3)} + O_DIRECT write+fsync {_f(floor_parts[1], '', 3)}): {_f(floor, 's/GiB', 3)}")
    lost, tlost = med(a, "ours", "lost_s"), med(a, "torch", "lost_s")
    add("async: compute lost per save <= 1/5 of torch DCP's", _ratio(lost, tlost), "<=", 0.2, "ours/torch",
        f"; ours {_f(lost, 's', 3)}, torch DCP {_f(tlost, 's', 3)}")
    add("async: blocking <= 1.2x one memcpy", a.get("blocking_vs_memcpy"), "<=", 1.2, "blocking/memcpy",
        f"; ours blocks {_f(ob, 's', 3)}, memcpy {_f(a.get('memcpy_reused_s'), 's', 3)}")
    for key, word in (("model_save", "save"), ("model_load", "load")):
        e = m.get(key) or {}
        add(f"FSDP2 + AdamW model {word} >= 0.95x the paired limit", e.get("ours_vs_paired"), ">=", 0.95,
            "ours/raw GiB/s", f"; CPU s/GiB: ours {_f(med(e, 'ours', 'cpu_s_per_GiB'))}, torch DCP "
            f"{_f(med(e, 'torch', 'cpu_s_per_GiB'))}, raw {_f(med(e, 'raw', 'cpu_s_per_GiB'))}")

    # ---- issue 47: loads at the limit, on the many-tensor state dict (the 26-tensor one too)
    issue[0] = 47
    for label, r in reversed(sets):
        s = r["scenarios"]["load_same"]
        fig = (f" [{_f(s.get('ours_vs_paired_reps'))}]; ours {_f(med(s, 'ours'))}, raw readinto "
               f"{_f(s.get('paired_limit_GiBps'))}, torch DCP {_f(med(s, 'torch'))} GiB/s; ours/torch = "
               f"{_f(s.get('ours_vs_torch'))}")
        add(f"[{label}] same-layout load >= 0.95x raw readinto", s.get("ours_vs_paired"), ">=", 0.95,
            "ours/raw", fig)
        s = r["scenarios"]["load_reshard_s0_s1"]
        fig = (f" [{_f(s.get('ours_vs_paired_reps'))}]; ours {_f(med(s, 'ours'))}, raw readinto "
               f"{_f(s.get('paired_limit_GiBps'))}, torch DCP {_f(med(s, 'torch'))} GiB/s")
        add(f"[{label}] Shard(0)->Shard(1) load >= 0.9x raw readinto", s.get("ours_vs_paired"), ">=", 0.9,
            "ours/raw", fig)
        add(f"[{label}] Shard(0)->Shard(1) load >= 2x torch DCP", s.get("ours_vs_torch"), ">=", 2.0,
            "ours/torch", f"; ours {_f(med(s, 'ours'))}, torch DCP {_f(med(s, 'torch'))} GiB/s")

    # ---- issue 12: planning (bench_scale.py has the full set)
    issue[0] = 12
    p = res.get("planning", {})
    t = p.get("target") or {}
    extra = " (extrapolated: not run, see planning notes)" if t.get("extrapolated") else ""
    add(f"planning + metadata, {t.get('ranks', 8192)} ranks x {t.get('tensors', 1000)} tensors < 5 s",
        t.get("total_s"), "<", 5.0, "seconds", extra + (f"; metadata {human_bytes(t['metadata_bytes'])}"
                                                          if t.get("metadata_bytes") else ""))
    add("planning grows linearly (log-log slope of time vs ranks)", p.get("slope"), "<=", 1.15, "slope",
        f" over measured points {p.get('measured_ranks')}")
    return out


def _baseline_hsdp(baseline: dict | None, res: dict, h: dict) -> tuple[float | None, str]:
    """The baseline's HSDP load median, when that run had the same state and world size."""
    if not baseline:
        return None, " (no baseline: pass --baseline)"
    bh = (baseline.get("results") or {}).get("hsdp") or {}
    same = bh.get("bytes") == h.get("bytes") and bh.get("world_size") == h.get("world_size")
    if not same:
        return None, (f" (baseline is for {human_bytes(bh.get('bytes') or 0)} on {bh.get('world_size')} ranks: "
                      "not comparable)")
    return (bh.get("load") or {}).get("variants", {}).get("ours", {}).get("seconds", {}).get("median"), ""


def _f(v: float | None, unit: str = "", digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v:.{digits}f}{(' ' + unit) if unit else ''}"


def planning_fit(planning: dict) -> dict:
    """Add the log-log slope of total time vs ranks over the measured points."""
    pts = [p for p in planning.get("points", []) if not p.get("extrapolated") and p.get("total_s")]
    planning["measured_ranks"] = [p["ranks"] for p in pts]
    if len(pts) >= 2:
        xs = [math.log(p["ranks"] * p["tensors"]) for p in pts]
        ys = [math.log(p["total_s"]) for p in pts]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        den = sum((x - mx) ** 2 for x in xs)
        planning["slope"] = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else None
    else:
        planning["slope"] = None
    return planning


# ---------------------------------------------------------------------------- markdown


def _cell(stats: dict | None, digits: int = 2) -> str:
    if not stats or not stats.get("values"):
        return "–"
    if len(stats["values"]) == 1:
        return f"{stats['median']:.{digits}f}"
    return f"{stats['median']:.{digits}f} ({stats['min']:.{digits}f}–{stats['max']:.{digits}f})"


def _med(entry: dict | None, key: str = "cpu_s_per_GiB") -> str:
    st = (entry or {}).get(key)
    return "–" if not st or not st.get("values") else f"{st['median']:.2f}"


def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}x"


def markdown(doc: dict) -> str:
    cfg, mach, res = doc["config"], doc["machine"], doc["results"]
    sc = res["scenarios"]
    L: list[str] = []
    L.append(f"# DCP benchmark — {doc['started']}")
    L.append("")
    L.append(f"`{doc['command']}`")
    L.append("")
    L.append(f"- state: {human_bytes(cfg['size_bytes'])} global, {cfg['tensors']} 2-D tensors (fp32/bf16), "
             f"{cfg['world_size']} ranks on gloo, {cfg['reps']} repetitions (median, min–max), "
             f"warm-up saves: {cfg['warmup']}")
    L.append(f"- storage: `{cfg['dir']}` ({mach.get('fs', '?')}); sync_files/fsync on for every save; "
             f"loads cold (page cache dropped with {mach.get('cold_method', '?')}; resident before a cold read: "
             f"{mach.get('resident_before_max', 'n/a')})")
    L.append(f"- machine: {mach['nproc']} cores, {human_bytes(mach['mem_total'])} RAM, {mach['kernel']}; "
             f"torch {mach['torch']}; hyper_parallel {mach['git']}")
    L.append(f"- load average: start `{mach['uptime_start']}`; end `{mach['uptime_end']}`")
    L.append("")
    L.append(f"## Save and load, {cfg['tensors']} tensors (GiB/s of the global state, higher is better)")
    L.append("")
    L.extend(_save_load_table(res, ("sync_save", *LOADS)))
    L.append("")
    many = res.get("many")
    if many:
        L.append(f"## Save and load, {many['tensors']} tensors (same size, the shape of a real model)")
        L.append("")
        L.extend(_save_load_table(many, ("sync_save", "load_same", "load_reshard_s0_s1")))
        L.append("")
    L.append("## CPU per GiB (all threads of all ranks) beside wall time")
    L.append("")
    L.extend(cpu_table(res, cfg.get("tensors")))
    L.append("")
    L.append("Bytes read per load (all ranks, first repetition): needed = bytes of the targets; "
             "ours = the reader's `bytes_read`; syscall = `rchar` of the ranks (torch's reads show here); "
             "storage = `read_bytes` fetched from the device.")
    L.append("")
    L += table_head("load", "variant", "needed", "ours bytes_read", "syscall", "storage", "read / needed",
                    "values correct")
    for key in LOADS:
        e = sc[key]
        for variant, b in e.get("bytes", {}).items():
            L.append(f"| {e['title']} | {variant} | {human_bytes(b['needed'])} | "
                     f"{human_bytes(b['reader_bytes_read']) if 'reader_bytes_read' in b else '–'} | "
                     f"{human_bytes(b['syscall_read'] or 0)} | {human_bytes(b['storage_read'] or 0)} | "
                     f"{_x(b.get('read_over_needed'))} | "
                     f"{'– (loads nothing)' if variant == 'raw' else _yes(e['correct'].get(variant))} |")
    L.append("")
    m = res.get("model")
    if m:
        L.append(f"## Model-shaped: FSDP2 + AdamW ({cfg.get('model_params', 0) / 1e6:.1f} M parameters, "
                 f"{human_bytes(m['bytes'])} of model + optimizer state, {cfg['world_size']} ranks)")
        L.append("")
        L.append("Save = `get_state_dict` + save; load = `get_state_dict` + load + `set_state_dict` (cold); "
                 "the library call alone in the last columns. " + cfg.get("bytecheckpoint", ""))
        L.append("")
        L.append("| operation | ours s | torch DCP s | torch / ours | ours GiB/s | call alone: ours s | torch s | "
                 "torch / ours | values correct |")
        L.append("|---|---|---|---|---|---|---|---|---|")
        for key in ("model_save", "model_load"):
            e = m.get(key)
            if not e:
                continue
            v, c = e["variants"], e.get("call_s", {})
            ok = e.get("correct") or {}
            L.append(f"| {e['title']} | {_cell(v.get('ours', {}).get('seconds'), 3)} | "
                     f"{_cell(v.get('torch', {}).get('seconds'), 3)} | {_x(e.get('ours_vs_torch'))} | "
                     f"{_cell(v.get('ours', {}).get('GiBps'))} | {_cell(c.get('ours'), 3)} | "
                     f"{_cell(c.get('torch'), 3)} | "
                     f"{_x(e.get('call_ours_vs_torch'))} | "
                     + (", ".join(f"{k} {'yes' if x else '**NO**'}" for k, x in ok.items()) or "–") + " |")
            if e.get("error"):
                L.append(f"| ↳ **error** | {e['error']} | | | | | | | |")
        L.append("")
    h = res.get("hsdp")
    if h:
        L.append(f"## Replicated (HSDP) load: {h['world_size']} ranks, mesh {h['mesh']} "
                 "(`[Replicate(), Shard(0)]`), cold")
        L.append("")
        ck = h.get("checkpoint_bytes", {})
        L.append(f"Checkpoint data files: ours {human_bytes(ck.get('ours') or 0)}, torch DCP "
                 f"{human_bytes(ck.get('torch') or 0)} (state {human_bytes(h['bytes'])}). Read per rank (first "
                 "repetition): ours = the reader's `bytes_read`; syscall = `rchar`; storage = `read_bytes` fetched "
                 "from the device. One page cache serves all ranks here, so storage reads hide the redundancy; "
                 "on shared storage each replica's reads reach the filesystem.")
        L.append("")
        lv = h["load"]["variants"]
        L.append(f"Load wall: ours {_cell(lv.get('ours', {}).get('seconds'), 3)} s (every replica reading for "
                 f"itself, `broadcast_replicated_tensors=False`: {_cell(lv.get('ours_noshare', {}).get('seconds'), 3)}"
                 f" s), torch DCP "
                 f"{_cell(lv.get('torch', {}).get('seconds'), 3)} s; save: ours "
                 f"{_cell(h['save']['variants'].get('ours', {}).get('seconds'), 3)} s, torch DCP "
                 f"{_cell(h['save']['variants'].get('torch', {}).get('seconds'), 3)} s.")
        L.append("")
        L += table_head("library", "rank", "ours bytes_read", "syscall", "storage")
        for lib, e in h.get("reads", {}).items():
            for row in e["per_rank"]:
                asked = human_bytes(row["reader_bytes_read"] or 0) if lib != "torch" else "–"
                L.append(f"| {lib} | {row['rank']} | {asked} | {human_bytes(row['syscall_read'] or 0)} | "
                         f"{human_bytes(row['storage_read'] or 0)} |")
            t = e["total"]
            L.append(f"| **{lib} total** | | {human_bytes(t['reader_bytes_read']) if lib != 'torch' else '–'} | "
                     f"{human_bytes(t['syscall_read'])} | {human_bytes(t['storage_read'])} |")
            L.append(f"| {lib}: read / checkpoint | | {_x(e.get('asked_over_checkpoint'))} (asked) | | "
                     f"{_x(e.get('storage_over_checkpoint'))} (storage) |")
        L.append("")
    L.append(f"## Raw limits of this machine ({cfg['world_size']} processes in parallel, one file each, "
             f"{cfg['io_chunk_mib']:g} MiB per call)")
    L.append("")
    L += table_head("limit", "GiB/s (all ranks)", "seconds", "CPU s/GiB")
    for key, title in LIMITS.items():
        e = res["limits"].get(key)
        if e:
            L.append(f"| {title} | {_cell(e['GiBps'])} | {_cell(e['seconds'], 3)} | {_med(e)} |")
    L.append("")
    ref = sc["reference"]
    if ref["variants"]:
        L.append("## Single-process references (the whole state from one process)")
        L.append("")
        L += table_head("reference", "GiB/s", "seconds", "CPU s/GiB")
        for _, e in ref["variants"].items():
            L.append(f"| {e['title']} | {_cell(e['GiBps'])} | {_cell(e['seconds'], 3)} | {_med(e)} |")
        L.append("")
    a = sc["async_save"]
    L.append("## Async save (matmul loop running in every rank)")
    L.append("")
    if a["variants"]:
        L.append(f"Per rank: {human_bytes(a.get('local_bytes_per_rank') or 0)}; one memcpy of it into reused "
                 f"memory: {_f(a.get('memcpy_reused_s'), 's', 3)}; our sync save: "
                 f"{_f(a.get('ours_sync_save_s'), 's', 3)}. Blocking = the call's time (max over ranks); "
                 "committed = call to commit; kept = matmul rate while the save is in flight / idle rate; "
                 "background CPU = CPU time of the rank's other threads (the save's) from the call to commit; "
                 "compute lost = blocking + (1 - kept) x the time the save was in flight: the loop's time one "
                 "checkpoint costs (a fast save that is dense in CPU keeps a smaller share of a shorter window).")
        L.append("")
        L.append("| variant | blocking s | committed s | throughput kept | background CPU s per rank "
                 "| compute lost s per save |")
        L.append("|---|---|---|---|---|---|")
        for variant, e in a["variants"].items():
            name = {"ours": "ours", "torch": "torch DCP", "ours_first": "ours, first call (allocates)",
                    "torch_first": "torch DCP, first call",
                    "ours_flat": "ours, `AsyncCheckpointer(stage_bands=False)` (flat snapshot; bands copied later)",
                    "ours_flat_first": "ours, `stage_bands=False`, first call",
                    "ours_untiled": "ours, `planner.max_tiles = 1` (no column bands to copy)",
                    "ours_untiled_first": "ours, `max_tiles = 1`, first call",
                    "ours_nice0": "ours, `AsyncCheckpointer(background_nice=0)` (threads at the loop's priority)",
                    "ours_nice0_first": "ours, `background_nice=0`, first call"}.get(variant, variant)
            bg = e.get("background_cpu_s") or summary([])
            lost = e.get("lost_s") or summary([])
            L.append(f"| {name} | {_cell(e['blocking_s'], 3)} | {_cell(e['committed_s'], 3)} | {_cell(e['kept'])} "
                     f"| {_cell(bg, 3)} | {_cell(lost, 3)} |")
        L.append("")
        L.append(f"ours/torch blocking {_x(a.get('blocking_vs_torch'))}; ours blocking/memcpy "
                 f"{_x(a.get('blocking_vs_memcpy'))}; ours committed/sync save {_x(a.get('committed_vs_sync'))} "
                 f"(torch {_x(a.get('torch_committed_vs_sync'))}); compute lost per save: ours "
                 f"{_f(a['variants'].get('ours', {}).get('lost_s', {}).get('median'), 's', 3)}, torch DCP "
                 f"{_f(a['variants'].get('torch', {}).get('lost_s', {}).get('median'), 's', 3)}.")
    if a.get("error"):
        L.append(f"**error**: {a['error']}")
    for note in doc.get("notes", []):
        if "async" in note:
            L.append(f"- {note}")
    L.append("")
    off = res.get("offline", {})
    L.append("## Offline transform (one process, no process group)")
    L.append("")
    if off.get("available"):
        L.append(f"`reshard.reshard(src, dst, dst_mesh={off['dst_mesh']})` on the {cfg['world_size']}-rank "
                 f"checkpoint, cold: {off['wall_s']:.2f} s, **{off['GiBps']:.2f} GiB/s**; peak RSS "
                 f"{human_bytes(off['peak_rss'])} ({human_bytes(off['peak_above_before'])} above the "
                 f"{human_bytes(off['rss_before'])} before it); {human_bytes(off['src_bytes'])} in, "
                 f"{human_bytes(off['dst_bytes'])} out. `offline_transform` exists: "
                 f"{off.get('offline_transform_exists')}.")
    else:
        L.append(f"Skipped: {off.get('note', 'not run')}")
    L.append("")
    p = res.get("planning", {})
    L.append("## Planning and metadata (one rank of R simulated under torch's fake process group)")
    L.append("")
    if p.get("points"):
        L.append("Total = local plan + exchange decode + global plan + build metadata + serialise (a first save; "
                 "the plan cache skips decode and global plan later). Internals behind "
                 "`benchmarks/scale_adapter.py`; more cases in `benchmarks/bench_scale.py`.")
        L.append("")
        L.append("| ranks x tensors | local plan s | exchange decode s | global plan s | build metadata s | "
                 "to_json s | **total s** | metadata | from_json s | load plan s | peak RSS (VmHWM) |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for q in p["points"]:
            ex = " (extrapolated)" if q.get("extrapolated") else ""
            L.append(f"| {q['ranks']} x {q['tensors']}{ex} | {_f(q.get('local_plan_s'))} | "
                     f"{_f(q.get('exchange_decode_s'))} | {_f(q.get('global_plan_s'))} | "
                     f"{_f(q.get('build_metadata_s'))} | {_f(q.get('to_json_s'))} | **{_f(q.get('total_s'))}** | "
                     f"{human_bytes(q.get('metadata_bytes') or 0)} | {_f(q.get('from_json_s'))} | "
                     f"{_f(q.get('load_plan_s'))} | {human_bytes(q.get('vmhwm') or 0)} |")
        L.append("")
        L.append(f"log-log slope of total time vs ranks x tensors over the measured points: "
                 f"{_f(p.get('slope'))} (1.0 = linear).")
        for note in p.get("notes", []):
            L.append(f"- {note}")
    else:
        L.append(f"Skipped: {p.get('note', 'not run')}")
    L.append("")
    L.append("## Targets")
    for tag, title in ISSUES:
        group = [t for t in doc["targets"] if t.get("issue") == tag]
        if not group:
            continue
        L.append("")
        L.append(f"### {title}")
        L.append("")
        for t in group:
            mark = {True: "**met**", False: "**NOT met**", None: "n/a"}[t["met"]]
            L.append(f"- {mark} — {t['target']}: {t['detail']}")
    if doc.get("profile"):
        L.append("")
        L.append("## Profile (py-spy on rank 0, wall-clock samples incl. waits, of the operation only)")
        for name, prof in doc["profile"].items():
            L.append("")
            L.append(f"### {name} ({prof['samples']} samples)")
            L.append("")
            L.append("threads: " + ", ".join(f"{t} {share:.0%}" for t, share in prof["threads"]))
            L.append("")
            L += table_head("innermost frame (self)", "share", "library frame (inclusive)", "share")
            rows = max(len(prof["self"][:12]), len(prof["inclusive"][:12]))
            for i in range(rows):
                a = prof["self"][i] if i < len(prof["self"]) else ("", None)
                b = prof["inclusive"][i] if i < len(prof["inclusive"]) else ("", None)
                L.append(f"| `{a[0]}` | {'' if a[1] is None else f'{a[1]:.0%}'} | `{b[0]}` | "
                         f"{'' if b[1] is None else f'{b[1]:.0%}'} |")
    other = [n for n in doc.get("notes", []) if "async" not in n]
    if other:
        L.append("")
        L.append("## Notes")
        for n in other:
            L.append(f"- {n}")
    return "\n".join(L) + "\n"


ISSUES = ((47, "Issue 47: loads at the limit (files read once, then cold per rep; alternating; ratios of medians, "
               "[per-rep pairs] in brackets)"),
          (33, "Issue 33: CPU per GiB, against the paired limits"), (13, "Issue 13: I/O engine"),
          (12, "Issue 12: planning at scale (full set: bench_scale.py)"),
          ("r1", "Release 1"))


def targets_text(doc: dict) -> str:
    lines = ["Targets:"]
    for tag, title in ISSUES:
        group = [t for t in doc["targets"] if t.get("issue") == tag]
        if group:
            lines.append(f" {title}")
        lines += [target_line(t) for t in group]
    return "\n".join(lines)


def cpu_table(res: dict, tensors: int | None = None) -> list[str]:
    """Per scenario, wall seconds and CPU seconds per GiB (all threads of all ranks: each
    rank's ``getrusage`` around the call, summed) of ours, torch DCP and the raw limit.

    The raw limit is the paired one (the same bytes written, or the same files read, plainly
    in the same repetitions) where the scenario has it, else the limit measured at the start
    on fresh files (marked *)."""
    L = ["| state | scenario | ours s | ours CPU s/GiB | torch DCP s | torch CPU s/GiB | raw limit s | "
         "raw CPU s/GiB | ours / raw CPU | ours / raw GiB/s |", "|---|---|---|---|---|---|---|---|---|---|"]
    sets = [(f"{tensors or res.get('tensors', '?')} tensors", res)]
    if res.get("many"):
        sets.append((f"{res['many'].get('tensors', '?')} tensors", res["many"]))
    if res.get("model"):
        sets.append(("FSDP2 + AdamW", {"scenarios": {k: v for k, v in res["model"].items() if k != "bytes"},
                                       "limits": res.get("limits", {})}))
    for label, r in sets:
        for e in r["scenarios"].values():
            if not isinstance(e, dict) or "variants" not in e or "limit" not in e or not e["variants"]:
                continue
            v = e["variants"]
            raw, mark = v.get("raw"), ""
            if raw is None:
                raw, mark = r.get("limits", {}).get(e["limit"]) or {}, "*"
            oc, rc = (v.get("ours") or {}).get("cpu_s_per_GiB", {}), raw.get("cpu_s_per_GiB", {})
            ratio = _ratio(oc.get("median"), rc.get("median"))
            speed = e.get("ours_vs_paired") if not mark else e.get("ours_vs_limit")
            ours, theirs = v.get("ours") or {}, v.get("torch") or {}
            L.append(f"| {label} | {e['title']} | {_cell(ours.get('seconds'), 3)} | {_med(ours)} | "
                     f"{_cell(theirs.get('seconds'), 3)} | {_med(theirs)}"
                     f" | {_cell(raw.get('seconds'), 3)}{mark} | {_med(raw)}{mark} | {_x(ratio)} | {_x(speed)} |")
            if "ours_noverify" in v:
                nv = v["ours_noverify"]
                L.append(f"| {label} | ↳ ours with verify=False | {_cell(nv.get('seconds'), 3)} | {_med(nv)} | | | | | "
                         f"{_x(e.get('ours_noverify_cpu_vs_paired'))} | {_x(e.get('ours_noverify_vs_paired'))} |")
    return L


def cpu_markdown(doc: dict) -> str:
    """``cpu_per_gib.md``: the CPU-per-GiB table of a run, with its command and machine."""
    cfg, mach = doc["config"], doc["machine"]
    L = [f"# CPU per GiB — {doc['started']}", "", f"`{doc['command']}`", "",
         f"- state: {human_bytes(cfg['size_bytes'])} global, {cfg['world_size']} ranks on gloo, {cfg['reps']} "
         f"repetitions (median, min–max); saves fsync; loads cold",
         f"- machine: {mach['nproc']} cores, {mach['kernel']}, {mach.get('fs', '?')}; hyper_parallel {mach['git']}; "
         f"load average at start {mach.get('loadavg_start')}, at end {mach.get('loadavg_end')}",
         "- CPU = user + system seconds of every thread of every rank (each rank's `getrusage(RUSAGE_SELF)` "
         "around the call, summed over ranks) per GiB of the global state. raw = the same bytes written "
         "(`write` + `fsync`, one file per rank) or the same files read (`readinto`) plainly, in the same "
         "repetitions; * = the limit measured at the start on fresh files instead.", ""]
    L += cpu_table(doc["results"], cfg.get("tensors"))
    group = [t for t in doc.get("targets", []) if t.get("issue") == 33]
    if group:
        L += ["", "Targets (issue 33):", ""]
        for t in group:
            mark = {True: "**met**", False: "**NOT met**", None: "n/a"}[t["met"]]
            L.append(f"- {mark} — {t['target']}: {t['detail']}")
    return "\n".join(L) + "\n"


def _yes(ok: bool | None) -> str:
    return "yes" if ok else "**NO**"


def _save_load_table(res: dict, keys: tuple[str, ...]) -> list[str]:
    sc = res["scenarios"]
    L = ["| scenario | ours | torch DCP | ours / torch | raw limit | ours / limit | ours / O_DIRECT limit | "
         "CPU s/GiB: ours, torch |", "|---|---|---|---|---|---|---|---|"]
    for key in keys:
        e = sc[key]
        lim = res["limits"].get(e["limit"], {}).get("GiBps")
        v = e["variants"]
        L.append(f"| {e['title']} | {_cell(v.get('ours', {}).get('GiBps'))} | {_cell(v.get('torch', {}).get('GiBps'))}"
                 f" | {_x(e.get('ours_vs_torch'))} | {_cell(lim)} ({LIMITS.get(e['limit'], e['limit'])})"
                 f" | {_x(e.get('ours_vs_limit'))} | {_x(e.get('ours_vs_direct'))} | "
                 f"{_med(v.get('ours'))}, {_med(v.get('torch'))} |")
        if "ours_noverify" in v:
            L.append(f"| ↳ same, ours with verify=False | {_cell(v['ours_noverify'].get('GiBps'))} | | "
                     f"{_x(e.get('ours_noverify_vs_torch'))} | | {_x(e.get('ours_noverify_vs_limit'))} | | "
                     f"{_med(v['ours_noverify'])} |")
        if "raw" in v:
            nov = f" (verify=False {_x(e.get('ours_noverify_vs_paired'))})" if "ours_noverify_vs_paired" in e else ""
            what = PAIRED.get(e["limit"], "the same bytes, same reps")
            L.append(f"| ↳ ours vs the paired limit: {what} | | | | "
                     f"{_cell(v['raw'].get('GiBps'))} | {_x(e.get('ours_vs_paired'))}{nov} | | "
                     f"{_med(v['raw'])} (raw) |")
        if e.get("error"):
            L.append(f"| ↳ **error** | {e['error']} | | | | | | |")
        ok = e.get("correct") or {}
        if ok and not all(ok.values()):
            L.append(f"| ↳ **wrong values loaded** | {', '.join(k for k, x in ok.items() if not x)} | | | | | | |")
    return L


# ---------------------------------------------------------------------------- chart


def chart(doc: dict, path: str) -> str | None:
    """A PNG: throughput per scenario, async timings, planning growth. None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    res = doc["results"]
    sc = res["scenarios"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.5), gridspec_kw={"width_ratios": [3, 1.3, 1.5]})
    ax = axes[0]
    keys = ["sync_save", *LOADS]
    labels = [sc[k]["title"].replace(" (cold)", "\n(cold)").replace("resharded ", "resharded\n") for k in keys]
    series = [("ours", "#1f77b4"), ("ours_noverify", "#aec7e8"), ("torch", "#ff7f0e")]
    width = 0.2
    for i, (variant, color) in enumerate(series):
        vals, errs = [], [[], []]
        for k in keys:
            st = sc[k]["variants"].get(variant, {}).get("GiBps")
            m = st["median"] if st and st.get("values") else 0.0
            vals.append(m)
            errs[0].append(m - st["min"] if st and st.get("values") else 0)
            errs[1].append(st["max"] - m if st and st.get("values") else 0)
        ax.bar([x + (i - 1.5) * width for x in range(len(keys))], vals, width, yerr=errs, color=color,
               label={"ours": "hyper-parallel", "ours_noverify": "hyper-parallel, verify=False",
                      "torch": "torch DCP"}[variant], capsize=2)
    lims = [res["limits"].get(sc[k]["limit"], {}).get("GiBps", {}).get("median") or 0 for k in keys]
    ax.bar([x + 1.5 * width for x in range(len(keys))], lims, width, color="#7f7f7f", label="raw limit")
    ax.set_xticks(range(len(keys)), labels, fontsize=8)
    ax.set_ylabel("GiB/s (global state / wall time)")
    ax.set_ylim(0, 1.3 * max([*lims, 0.1]))
    ax.set_title(f"{human_bytes(doc['config']['size_bytes'])}, {doc['config']['world_size']} ranks, "
                 f"median and min–max of {doc['config']['reps']}")
    ax.legend(fontsize=8)
    ax = axes[1]
    a = sc["async_save"]["variants"]
    names = [v for v in ("ours", "torch") if v in a]
    for j, metric in enumerate(("blocking_s", "committed_s")):
        ax.bar([x + (j - 0.5) * 0.35 for x in range(len(names))], [a[v][metric]["median"] for v in names], 0.35,
               label=metric.replace("_s", " (s)"), color=["#2ca02c", "#98df8a"][j])
    memcpy = sc["async_save"].get("memcpy_reused_s")
    if memcpy:
        ax.axhline(memcpy, color="k", ls=":", lw=1, label="memcpy into reused memory")
    for x, v in enumerate(names):
        kept = a[v]["kept"].get("median")
        if kept is not None and not math.isnan(kept):
            ax.text(x, a[v]["committed_s"]["median"], f"kept {kept:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), ["hyper-parallel" if v == "ours" else "torch DCP" for v in names])
    ax.set_title("async save")
    ax.legend(fontsize=8)
    ax = axes[2]
    pts = res.get("planning", {}).get("points", [])
    meas = [p for p in pts if not p.get("extrapolated")]
    extra = [p for p in pts if p.get("extrapolated")]
    if meas:
        ax.loglog([p["ranks"] for p in meas], [p["total_s"] for p in meas], "o-", label="measured")
    if extra:
        ax.loglog([p["ranks"] for p in extra], [p["total_s"] for p in extra], "x--", label="extrapolated")
    ax.axhline(5.0, color="r", ls=":", lw=1, label="target 5 s")
    ax.set_xlabel("simulated ranks")
    ax.set_ylabel("planning + metadata (s)")
    ax.set_title(f"planning, {pts[0]['tensors'] if pts else '?'} tensors")
    ax.legend(fontsize=8)
    fig.suptitle(f"DCP benchmark {doc['started']} — load avg {doc['machine']['loadavg_start']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


_IDLE = ("Condition.wait ", "Event.wait ", "Thread._wait_for_tstate_lock ", "_worker (concurrent/futures/thread.py",
         "SimpleQueue.get ", "Queue.get ")


def profile_summary(path: str, top: int = 25) -> dict | None:
    """Shares per function from py-spy's raw (collapsed, ``--threads``) output.

    Only samples of the operation count: the library's worker threads (``dcp-*``) and stacks
    of other threads that pass through ``hyper_parallel/`` (so the wait for py-spy to attach
    and the barriers around the operation are left out). Samples of a thread other than the
    main one that sits idle (waiting for work: a pool's queue, a condition, the async
    writer's loop) are dropped too: they are not the operation's cost, while the main
    thread's waits are its wall time. ``self``: the innermost frame; ``inclusive``: every
    library frame on the stack; ``threads``: samples per thread name.
    """
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    self_counts: dict[str, int] = {}
    incl: dict[str, int] = {}
    threads: dict[str, int] = {}
    total = 0
    for line in lines:
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        thread = frames[0].split(": ", 1)[-1] if frames[0].startswith("thread (") else "?"
        frames = [fr for fr in frames if fr and not fr.startswith(("thread (", "process "))]
        if not frames or not (thread.startswith("dcp-") or any("hyper_parallel/" in fr for fr in frames)):
            continue
        if thread != "MainThread" and frames[-1].startswith(_IDLE):
            continue
        count = int(n)
        total += count
        name = thread.rstrip("0123456789_") + "*" if thread.startswith("dcp-") else thread
        threads[name] = threads.get(name, 0) + count
        self_counts[frames[-1]] = self_counts.get(frames[-1], 0) + count
        for fr in set(frames):
            if "hyper_parallel/" in fr:
                incl[fr] = incl.get(fr, 0) + count
    if not total:
        return None
    share = lambda d: [(k, v / total) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]]  # noqa: E731
    return {"samples": total, "self": share(self_counts), "inclusive": share(incl), "threads": share(threads),
            "raw": path}


__all__ = ["merge_ranks", "build_results", "targets", "markdown", "cpu_markdown", "cpu_table", "chart", "planning_fit",
           "profile_summary",
           "targets_text", "MiB"]
