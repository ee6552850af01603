"""A repro file in words: ``summary`` (the aligned lines of ``dilated-attention-repro show``) and
``describe_call`` (the keywords beyond the patterns, for replay reports and fuzz findings)."""

from __future__ import annotations

from typing import Any


def summary(spec: dict[str, Any], path: str | None = None) -> list[str]:
    """A repro file as aligned lines for a person: the call, each tensor's layout, masks, the error, and the
    command that replays it (``repro show``; ``--json`` prints the file itself)."""
    rows: list[tuple[str, str]] = []
    world, rank = int(spec.get("world_size") or 1), int(spec.get("rank") or 0)
    if path is not None:
        rows.append(("file", path))
    rows.append(("call", f"dilated_attention(q, k, v, segment_lengths={spec.get('segment_lengths')}, "
                         f"dilation_rates={spec.get('dilation_rates')})"))
    options = {name: spec[name] for name in ("mode", "causal", "softmax_scale", "kernel") if name in spec}
    options.update(spec.get("kwargs") or {})
    rows.append(("options", ", ".join(f"{name}={value!r}" for name, value in options.items()) or "none"))
    rows.append(("ranks", "one process" if world == 1 else f"rank {rank} of {world}, backend {spec.get('backend')}"))
    for name in ("q", "k", "v"):
        t = spec.get(name) or {}
        if not t:
            continue
        shape = "x".join(str(x) for x in t.get("shape", []))
        layout = f"stride {tuple(t.get('stride', []))}, offset {t.get('storage_offset', 0)}"
        address = t.get("data_ptr_mod_16")
        rows.append((name, f"{shape} {t.get('dtype')} on {t.get('device')}, {layout}"
                           + ("" if address in (None, 0) else f", address {address} bytes past 16-byte alignment")
                           + (", requires_grad" if t.get("requires_grad") else "")))
    mask = spec.get("key_padding_mask")
    if mask:
        rows.append(("key_padding_mask", f"{'x'.join(map(str, mask.get('shape', [])))} {mask.get('dtype', '')}, "
                                         f"{100 * mask.get('density', 0):.1f}% padded"))
    docs = spec.get("cu_seqlens")
    if docs is not None:
        if isinstance(docs, list) and len(docs) > 1:
            lengths = [b - a for a, b in zip(docs, docs[1:])] if all(isinstance(x, int) for x in docs) else docs
            rows.append(("cu_seqlens", f"{len(docs) - 1} documents, lengths {lengths}"))
        else:
            rows.append(("cu_seqlens", repr(docs)))
    if spec.get("tensors"):
        rows.append(("tensors", f"saved in {spec['tensors']}"))
    rows.append(("error", spec.get("error") or "none recorded"))
    rows.append(("replay", f"dilated-attention-repro replay {path or 'FILE'}"
                           + ("" if world == 1 else f"  (or torchrun --nproc_per_node={world} "
                                                    f"-m dilated_attention.tools.repro replay ...)")))
    width = max(len(name) for name, _ in rows)
    return [f"{name:>{width}s}  {text}" for name, text in rows]


def describe_call(spec: dict[str, Any]) -> str:
    """The keywords beyond the patterns, in a few words (for report lines and fuzz findings)."""
    parts = []
    kwargs = spec.get("kwargs") or {}
    for key in ("strategy", "pad_to_segments", "head_offsets"):
        if key in kwargs:
            parts.append(f"{key}={kwargs[key]!r}")
    desc = spec.get("key_padding_mask")
    if isinstance(desc, dict):
        if "type" in desc:
            parts.append(f"key_padding_mask of type {desc['type']}")
        else:
            how = [f"density {desc.get('density', 0)}"]
            how += [f"{desc['runs']} run(s)"] if desc.get("runs") else []
            how += ["a tail"] if desc.get("tail") else []
            how += [f"exact rows {[p['rows'] for p in desc['exact']]}"] if desc.get("exact") else []
            parts.append(f"key_padding_mask {desc.get('dtype', 'bool')} {desc.get('shape')} ({', '.join(how)})")
    if spec.get("cu_seqlens") is not None:
        cu = spec["cu_seqlens"]
        parts.append(f"cu_seqlens {cu if not isinstance(cu, list) or len(cu) <= 12 else cu[:6] + ['...'] + cu[-2:]}")
    return ", ".join(parts)
