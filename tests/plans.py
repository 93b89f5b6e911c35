"""Step plans built by hand, through the flat encoding that SPEC.md ("apply") documents: tests use them to
feed a worker plans that no manager would make (out of range, duplicated destinations...)."""

import struct

from hisparse import StepPlan

_SECTIONS = ("cleared_rows", "seq_lens", "table_updates", "hot_updates", "restores", "materialize", "scheduled",
             "transitions")
_RESIDENCY = {"full": 0, "mixed": 1, "none": 2}


def encode(missing_blocks=0, released_pages=0, lost_pages=0, **sections) -> bytes:
    """``sections`` as ``StepPlan``'s views give them: cleared_rows [row], seq_lens [(row, len, request)] or
    [(row, len, request, resident)] (not resident when left out), table_updates
    [(row, page, gpu_block, host_block, releasable)], hot_updates [(row, blocks)], restores [(gpu, host)],
    materialize [(transfer, gpu, host)], scheduled [(request, row, start, tokens)], transitions
    [(request, from, to)]. Values are written as the wire's u32 (negative ones wrap, as they would on it)."""
    unknown = set(sections) - set(_SECTIONS)
    if unknown:
        raise TypeError(f"unknown sections {unknown}")
    s = {name: list(sections.get(name, ())) for name in _SECTIONS}
    hot_blocks = max((len(blocks) for _, blocks in s["hot_updates"]), default=0)
    words = [int.from_bytes(b"HSPL", "little"), 2, missing_blocks, released_pages, lost_pages, hot_blocks]
    words += [len(s[name]) for name in _SECTIONS]
    words += s["cleared_rows"]
    words += [v for row, n, _, *flag in s["seq_lens"] for v in (row, n, int(bool(flag and flag[0])))]
    words += [v for row, page, gpu, host, flag in s["table_updates"] for v in (row, page, gpu, host, int(flag))]
    for row, blocks in s["hot_updates"]:
        words += [row, len(blocks), *blocks, *[0] * (hot_blocks - len(blocks))]
    words += [v for pair in s["restores"] for v in pair]
    words += [v for _, gpu, host in s["materialize"] for v in (gpu, host)]
    words += [v for _, row, start, n in s["scheduled"] for v in (row, start, n)]
    words += [_RESIDENCY[v] for _, a, b in s["transitions"] for v in (a, b)]
    if len(words) % 2:
        words.append(0)
    longs = [t for t, _, _ in s["materialize"]] + [r for _, _, r, *_ in s["seq_lens"]]
    longs += [r for r, *_ in s["scheduled"]] + [r for r, *_ in s["transitions"]]
    return struct.pack(f"<{len(words)}I", *(w & 0xFFFFFFFF for w in words)) + struct.pack(f"<{len(longs)}Q", *longs)


def plan(**fields) -> StepPlan:
    return StepPlan.from_bytes(encode(**fields))


def heat(rankings, hottest=None) -> bytes:
    """An encoded heat summary: request id -> coldest [(heat, page), ...] (a dict, or a list of pairs to repeat
    an id), and ``hottest`` the same for the hottest pages (none by default), written in the order given."""
    rankings = list(rankings.items()) if isinstance(rankings, dict) else list(rankings)
    hot = dict(hottest or {})
    offsets, cold, pages, heats = [0], [], [], []
    for rid, entries in rankings:
        cold.append(len(entries))
        both = list(entries) + list(hot.get(rid, ()))
        heats += [h for h, _ in both]
        pages += [p for _, p in both]
        offsets.append(len(pages))
    words = [int.from_bytes(b"HSHT", "little"), 2, len(rankings), len(pages), *offsets, *cold, *pages, *heats]
    if len(words) % 2:
        words.append(0)
    return struct.pack(f"<{len(words)}I", *words) + struct.pack(f"<{len(rankings)}Q", *(r for r, _ in rankings))


def sections(plan: StepPlan) -> dict:
    """A plan's sections as :func:`encode` takes them (its views), to build a variant of a real plan."""
    return {name: list(getattr(plan, name)) for name in _SECTIONS}


def crafted(valid: bytes) -> list[tuple[str, bytes]]:
    """Byte strings no decoder may take, derived from the encoding of a valid plan: truncated, trailing
    bytes, bad magic or version, every count (and the hot-region width) inflated past the data, undefined
    flags and codes."""
    words = list(struct.unpack(f"<{len(valid) // 4}I", valid))
    out = [(f"truncated to {n} bytes", valid[:n]) for n in sorted({0, 3, 4, 8, 12, 24, 55, len(valid) // 2,
                                                                 len(valid) - 8, len(valid) - 1})]
    out += [("8 trailing bytes", valid + bytes(8)), ("1 trailing byte", valid + b"\0"),
            ("bad magic", b"HSPX" + valid[4:]), ("version 1", valid[:4] + struct.pack("<I", 1) + valid[8:]),
            ("version 3", valid[:4] + struct.pack("<I", 3) + valid[8:]),
            ("a heat summary's magic", b"HSHT" + valid[4:])]

    def with_word(i: int, value: int) -> bytes:
        w = list(words)
        w[i] = value & 0xFFFFFFFF
        return struct.pack(f"<{len(w)}I", *w)

    for i, name in enumerate(["hot-region width", *_SECTIONS], start=5):
        for value in (words[i] + 1, 2**31, 2**32 - 1):
            out.append((f"{name} count {value}", with_word(i, value)))
    lens_at = 14 + words[6]  # the first length entry's words, if any
    if words[7]:
        out.append(("length flag 2", with_word(lens_at + 2, 2)))
    table_at = lens_at + 3 * words[7]  # the first table update's words, if any
    if words[8]:
        out.append(("table flag 2", with_word(table_at + 4, 2)))
    return out
