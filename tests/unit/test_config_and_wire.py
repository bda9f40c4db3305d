import pytest

from service.contract import wire
from service.contract.config import SettingsError, load_settings


def test_invalid_setting_names_the_environment_variable(monkeypatch):
    monkeypatch.setenv("BLOCKSERVE_BLOCK_SIZE", "sixteen")
    monkeypatch.setenv("KV_CACHE_RATIO", "1.5")
    with pytest.raises(SettingsError) as excinfo:
        load_settings()
    assert "BLOCKSERVE_BLOCK_SIZE" in str(excinfo.value)
    assert "KV_CACHE_RATIO" in str(excinfo.value)


def test_proposal_names_are_read_without_prefix(monkeypatch):
    monkeypatch.setenv("ENABLE_V1_KVCACHE_SCHEDULER", "0")
    monkeypatch.setenv("KV_CACHE_RATIO", "0.3")
    settings = load_settings()
    assert settings.enable_v1_kvcache_scheduler is False
    assert settings.kv_cache_ratio == pytest.approx(0.3)


def test_redacted_settings_hide_the_api_key(monkeypatch):
    monkeypatch.setenv("BLOCKSERVE_API_KEY", "sekrit")
    shown = load_settings().redacted()
    assert shown["BLOCKSERVE_API_KEY"] != "sekrit"
    assert "sekrit" not in repr(shown)
    assert shown["BLOCKSERVE_BLOCK_SIZE"] == 16


def test_step_message_round_trips():
    step = wire.SchedulerOutput(
        step_id=7,
        new_requests=[
            wire.NewRequest(
                request_id="r1",
                token_ids=[1, 2, 3],
                num_prompt_tokens=3,
                sampling=wire.SamplingParams(max_tokens=4, seed=5),
                block_ids=[0],
                num_computed_tokens=0,
                num_scheduled_tokens=3,
            )
        ],
        running_requests=[wire.RunningRequest("r0", [9], 1)],
        preempted_request_ids=["r2"],
    )
    decoded = wire.decode(wire.encode(step))
    assert decoded == step
    assert decoded.num_scheduled_tokens == 4


@pytest.mark.parametrize(
    "frame",
    [b"", b"\x00", b"\x81\xa4type\xa5bogus", wire.encode(wire.Ping(version=wire.PROTOCOL_VERSION + 1))],
)
def test_bad_frames_raise_wire_error(frame):
    with pytest.raises(wire.WireError):
        wire.decode(frame)


def test_a_batch_whose_columns_disagree_in_length_is_rejected():
    frame = wire.encode(wire.DeltaBatch(token_request_ids=["r1", "r2"], token_ids=[5, 6]))
    wire.decode(frame)
    lopsided = frame.replace(b"\x92\x05\x06", b"\x91\x05")  # token ids [5, 6] -> [5]
    assert lopsided != frame
    with pytest.raises(wire.WireError, match="2 request ids for 1 tokens"):
        wire.decode(lopsided)


def test_a_frame_of_an_older_protocol_is_rejected():
    frame = wire.encode(wire.Ping(version=1))
    with pytest.raises(wire.WireError, match="protocol version 1"):
        wire.decode(frame)


def test_fields_travel_by_position_not_by_name():
    frame = wire.encode(wire.RequestDelta(request_id="r1", token_ids=[5]))
    assert b"request_id" not in frame and b"token_ids" not in frame
    assert wire.decode(frame) == wire.RequestDelta(request_id="r1", token_ids=[5])
