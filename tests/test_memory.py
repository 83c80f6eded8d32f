"""Memory planning: the start-up table's arithmetic, and errors that say what to change when the weights or one
sequence's cache do not fit."""

import pytest

from qwen4exp.memory import DeviceMemory, GiB, InsufficientMemoryError, MemoryPlan, check_weights_fit, plan_cache

H200 = DeviceMemory("cuda:0", int(139.8 * GiB), int(0.5 * GiB), 0.9)


def test_weights_that_fit_pass_and_the_share_excludes_what_others_use():
    assert H200.budget == int(139.8 * GiB * 0.9) - int(0.5 * GiB)
    check_weights_fit(H200, 119 * GiB, 48 * GiB, tables_on_device=False, weights_in_fp8=None)


def test_released_bf16_weights_name_fp8_and_the_host_table():
    """335 GiB of bf16 weights: fp8 is suggested (and said to be still too large alone when it is)."""
    with pytest.raises(InsufficientMemoryError) as e:
        check_weights_fit(H200, 234 * GiB, 95 * GiB, tables_on_device=True, weights_in_fp8=119 * GiB)
    msg = str(e.value)
    assert "--quantization fp8 (weights 234.0 GiB -> 119.0 GiB)" in msg and "cuda:0" in msg
    assert "--ple-table-device" not in msg  # the weights alone exceed the share: moving the table is no fix
    with pytest.raises(InsufficientMemoryError, match="still too large alone"):
        check_weights_fit(H200, 300 * GiB, 0, tables_on_device=False, weights_in_fp8=150 * GiB)


def test_a_table_on_the_gpu_that_does_not_fit_names_the_host_table():
    with pytest.raises(InsufficientMemoryError, match=r"--ple-table-device cpu \(the n-gram tables, 48.0 GiB"):
        check_weights_fit(H200, 119 * GiB, 48 * GiB, tables_on_device=True, weights_in_fp8=None)


def plan(budget_gib, max_model_len=32768, max_num_seqs=64):
    # flash-next per page of 16 tokens: 12 attention layers x 16 x (2 x 2 x 256 + 128 x 1.25) x 2 bytes
    return MemoryPlan("cuda:0", int(budget_gib * GiB), 16, 12 * 16 * 2368, 115 * 2**20, max_num_seqs + 1,
                      max_model_len, max_num_seqs)


def test_pages_fill_what_the_slots_leave_and_the_table_says_how_many_sequences_fit():
    p = plan_cache(plan(12.0))
    slots = 65 * 115 * 2**20
    assert p.num_pages == (int(12.0 * GiB) - slots) // p.page_bytes
    assert p.max_concurrent == min(64, (p.num_pages - 1) // 2048)
    text = "\n".join(p.lines())
    assert "65 slots" in text and f"{p.num_pages - 1} pages of 16 tokens" in text
    assert f"concurrent sequences of max_model_len 32768: {p.max_concurrent}" in text


def test_a_cache_without_room_for_one_sequence_names_the_largest_settings_that_fit():
    with pytest.raises(InsufficientMemoryError) as e:
        plan_cache(plan(7.0), hints=("--ple-table-device cpu",))
    msg = str(e.value)
    # 7 GiB hold 65 slots (7.3 GiB) and nothing else: a shorter context does not help, fewer sequences do
    fixes = msg.split("try ")[1]
    assert "--max-model-len" not in fixes
    seqs = int(fixes.split("--max-num-seqs ")[1].split(",")[0])
    one = plan(7.0, max_num_seqs=seqs)
    assert plan_cache(one).max_concurrent >= 1
    with pytest.raises(InsufficientMemoryError):
        plan_cache(plan(7.0, max_num_seqs=seqs + 1))
    assert msg.endswith("--ple-table-device cpu")


def test_num_pages_given_is_kept():
    assert plan_cache(plan(100.0), num_pages=4097).num_pages == 4097


def test_prefix_caching_checkpoints_say_what_turning_them_off_would_hold():
    """Prefix caching's checkpoint slots (max_num_seqs more state slots) take memory the pages could use: the table
    says how many sequences of max_model_len --no-enable-prefix-caching would hold, and the error names it when
    that alone makes one sequence fit."""
    def with_checkpoints(budget_gib):
        p = plan(budget_gib, max_num_seqs=32)
        p.checkpoint_slots, p.num_slots = 32, 2 * 32 + 1
        return p

    p = plan_cache(with_checkpoints(13.0))
    off = plan_cache(plan(13.0, max_num_seqs=32))
    assert p.max_concurrent < off.max_concurrent == p.max_concurrent_without_checkpoints
    text = "\n".join(p.lines())
    assert f": {p.max_concurrent} (max_num_seqs 32); {off.max_concurrent} with --no-enable-prefix-caching" in text
    assert "--no-enable-prefix-caching" not in "\n".join(off.lines())
    with pytest.raises(InsufficientMemoryError, match="--no-enable-prefix-caching"):
        plan_cache(with_checkpoints(6.0))
    assert plan_cache(plan(6.0, max_num_seqs=32)).max_concurrent >= 1
    given = plan_cache(with_checkpoints(13.0), num_pages=9000)  # given pages: no trade to offer
    assert "--no-enable-prefix-caching" not in "\n".join(given.lines())


def test_bf16_recurrent_state_halves_the_gdn_share_of_a_state_slot(tmp_path):
    """flash-next's state slot: 36 GDN layers of 48 x 128 x 128 recurrent state (108 MiB in fp32, 54 in bf16), beside
    the conv windows and the PLE window, which keep the model dtype; the start-up table names the state dtype."""
    import json

    import torch

    from qwen4exp.config import load_model_config
    from qwen4exp.model.state import slot_bytes
    from qwen4exp.weights.random_checkpoint import preset_config

    (tmp_path / "config.json").write_text(json.dumps(preset_config("flash-next")))
    c = load_model_config(str(tmp_path))
    fp32, bf16 = slot_bytes(c, torch.bfloat16), slot_bytes(c, torch.bfloat16, torch.bfloat16)
    assert fp32 - bf16 == 36 * 48 * 128 * 128 * 2 == 54 * 2**20
    assert 110 * 2**20 < fp32 < 111 * 2**20
    p = plan(12.0)
    p.slot_bytes, p.ssm_dtype = bf16, "bfloat16"
    assert "GDN recurrent (bfloat16) + conv" in "\n".join(plan_cache(p).lines())
