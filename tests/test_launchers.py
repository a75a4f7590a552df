

# --------------------------------------------------------------------------------------
# FSDP2 measured on real ranks, against its simulation on a fake process group
# --------------------------------------------------------------------------------------
def _fsdp_pair(**kw):
    from memlab.distributed.fsdp import measure_sharded, simulate_sharded
    from memlab.step import StepConfig

    step = StepConfig(model="tiny", seq=32, batch=2)
    return measure_sharded(step, 2, backend="gloo", **kw), simulate_sharded(step, 2, **kw)


@pytest.mark.distributed
def test_fsdp2_on_two_gloo_ranks_equals_its_simulation():
    """FSDP2's default (reshard_after_forward): the real ranks and the fake group run the same
    FSDPMemTracker over the same step; both ranks hold equal padded shards."""
    real, fake = _fsdp_pair()
    assert len(real.per_rank) == 2
    assert abs(real.peak_bytes / fake.peak_bytes - 1) < 0.02
    assert real.per_rank[0].peak_bytes == real.per_rank[1].peak_bytes
    for cat in ("parameters", "gradients", "optimizer"):
        assert real.by_category[cat] == fake.by_category[cat], cat


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_without_resharding_holds_gathered_parameters_longer():
    real, fake = _fsdp_pair(reshard_after_forward=False)
    default, _ = _fsdp_pair()
    assert abs(real.peak_bytes / fake.peak_bytes - 1) < 0.02
    assert real.peak_bytes > default.peak_bytes  # gathered weights kept to the backward


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_cpu_offload_on_cpu_ranks_moves_nothing_and_says_so():
    from memlab.distributed.fsdp import measure_sharded
    from memlab.step import StepConfig

    step = StepConfig(model="tiny", seq=32, batch=2)
    off, on = measure_sharded(step, 2, cpu_offload=True), measure_sharded(step, 2)
    assert off.by_category["optimizer"] == on.by_category["optimizer"]
    assert any("one memory" in n for n in off.notes)


def test_cli_measure_fsdp_refuses_what_it_cannot_honour(capsys):
    from memlab import cli

    assert cli.main(["measure", "--fsdp", "--zero", "2", "--world-size", "2"]) == 2
    assert "ZeRO-3" in capsys.readouterr().err
    assert cli.main(["measure", "--fsdp", "--offload", "optimizer", "--world-size", "2"]) == 2
    assert cli.main(["measure", "--cpu-offload"]) == 2
    assert "add --fsdp" in capsys.readouterr().err
