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


def test_stage3_model_states_are_made_once_per_old_rank_unless_cut_per_rank(ds_saves, monkeypatch):
    """A new rank's model-states file is the old rank r mod W's tree with new bookkeeping: where it holds no frozen
    fragments (cut per rank) the bytes are the same for every rank but 0 that starts from one old rank, so the segments
    are made once for each (a SharedBuild) and equal what the rank would make on its own; with fragments, each its own."""
    from ckpt_cli.core.write.plan import Literal, SharedBuild
    from ckpt_cli.formats.deepspeed.files import file_segments

    def literal_bytes(segments):
        return b"".join(bytes(s.data) for s in segments if isinstance(s, Literal))

    ckpt = open_checkpoint(ds_saves[2] / "stage3-fp32")
    name = "zero_pp_rank_{}_mp_rank_00_model_states.pt"
    cut = Stage3Reshard(ckpt, ckpt.source, 5, None)  # the save holds a frozen parameter: its fragments differ per rank
    assert len({id(cut._model_file(r, name.format(r))) for r in range(5)}) == 5
    reshard = Stage3Reshard(ckpt, ckpt.source, 5, None)
    real = reshard._model_states

    def unfrozen(rank):
        return {k: v for k, v in real(rank).items() if k != "frozen_param_fragments"}

    monkeypatch.setattr(reshard, "_model_states", unfrozen)
    made = [reshard._model_file(r, name.format(r)) for r in range(5)]
    assert made[1] is made[3] and made[2] is made[4] and made[0] is not made[2] and made[1] is not made[2]
    assert literal_bytes(made[3]) == literal_bytes(file_segments(unfrozen(3), name.format(3)))
    assert all(isinstance(f.build, SharedBuild) for f in reshard.files("tag") if "model_states" in f.relpath and f.build)
