"""A resharded ZeRO-3 rank's flat partition planned as copies (core/copies.py: numpy over every parameter at once) holds
the very bytes the part by part path makes (core/model.py FlatLayout.span, a piece per parameter), on a real DeepSpeed
save (conftest ds_saves: two param groups, sizes that leave padding at every odd world size, a frozen parameter) cut
into several sub-groups, in whole flats and in windows that start and end inside a parameter. DeepSpeed's own load of
the written output is in test_deepspeed.py and test_wide_plans.py."""

from __future__ import annotations

import pytest

from ckpt_cli.core.copies import PlannedFlat, gather
from ckpt_cli.core.reading import SourceFiles, as_bytes, read_elements, read_runs
from ckpt_cli.formats.deepspeed.stage3_reshard import Stage3Reshard
from ckpt_cli.ops.source import open_checkpoint


@pytest.mark.parametrize("source, world, sub_group_size", [(2, 5, None), (2, 7, 20), (3, 64, 8), (2, 1, 30)])
def test_a_stage3_flat_planned_as_copies_is_the_flat_made_part_by_part(ds_saves, source, world, sub_group_size):
    ckpt = open_checkpoint(ds_saves[source] / "stage3-fp32")
    reshard = Stage3Reshard(ckpt, ckpt.source, world, sub_group_size)
    assert sub_group_size is None or len(reshard.subs) > 2
    sources = SourceFiles()
    checked = gathered = 0
    try:
        for s in range(len(reshard.subs)):
            for key in ("", "exp_avg", "exp_avg_sq"):
                for rank in range(world):
                    entry = reshard.flat(s, key, rank, "flat")
                    layout = entry.pieces.layout
                    assert isinstance(layout, PlannedFlat)
                    n = entry.numel
                    for start, count in {(0, n), (1, max(0, n - 2)), (n // 3, min(5, n - n // 3)), (n - 1, 1)}:
                        if count <= 0:
                            continue
                        copies = layout.copies(start, count)
                        assert copies is not None and copies.size == count * 4
                        want = bytes(as_bytes(read_elements(entry, start, count, sources)))  # part by part
                        assert gather(copies, sources.mapped).tobytes() == want
                        assert b"".join(bytes(v) for v in read_runs(copies.byte_runs(), sources)) == want
                        assert all(copies.nbytes > 0) and all(copies.dst[1:] >= copies.dst[:-1] + copies.nbytes[:-1])
                        checked += 1
                        gathered += copies.gathered()
    finally:
        sources.close()
    assert checked >= 3 * world and (world == 1 or gathered)


def test_adjacent_copies_are_joined(ds_saves):
    """At the source's own world size each rank's flat is the source rank's flat of the same sub-group: one copy per
    source run of params laid end to end, not one per parameter."""
    ckpt = open_checkpoint(ds_saves[2] / "stage3-fp32")
    reshard = Stage3Reshard(ckpt, ckpt.source, 2, None)
    for rank in range(2):
        entry = reshard.flat(0, "exp_avg", rank, "flat")
        copies = entry.pieces.layout.copies(0, entry.numel)
        assert len(reshard.subs[0]) > 2 and len(copies.nbytes) == 1 and int(copies.nbytes[0]) == entry.numel * 4
