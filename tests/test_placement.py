import pytest

from flatcake_ray.config import PlacementConfig
from flatcake_ray.core.gva import Medium
from flatcake_ray.core.placement import PlacementInputs, PlacementPolicy
from flatcake_ray.errors import ConfigError

policy = PlacementPolicy(PlacementConfig(page_tokens=256, tau_tokens=1000, l_agent_tokens=50_000))


@pytest.mark.parametrize(
    ("inputs", "medium", "rule"),
    [
        (PlacementInputs(2, 1, None, 4000), Medium.DRAM, "shared"),
        (PlacementInputs(1, 3, 200, 8000), Medium.DRAM, "short-chat"),
        (PlacementInputs(1, 3, 5000, 8000), Medium.SSD, "agentic"),
        (PlacementInputs(1, 3, 200, 60_000), Medium.SSD, "agentic"),
        (PlacementInputs(3, 1, None, 60_000), Medium.SSD, "agentic"),  # a big fork stays off DRAM
        (PlacementInputs(1, 1, None, 2000), Medium.SSD, "one-shot"),
        (PlacementInputs(1, 4, None, 9000), Medium.SSD, "unknown-reply"),
    ],
)
def test_table_2(inputs, medium, rule):
    decision = policy.decide(inputs)
    assert (decision.medium, decision.rule) == (medium, rule)


def test_dram_full_spills_to_ssd():
    decision = policy.decide(PlacementInputs(1, 2, 10, 100), dram_has_room=False)
    assert (decision.medium, decision.rule) == (Medium.SSD, "spill")


def test_reply_inference_is_a_bound():
    assert policy.infer_prior_reply(turn=1, appended_tokens=10) is None
    assert policy.infer_prior_reply(turn=2, appended_tokens=512) == 512
    assert policy.infer_prior_reply(turn=2, appended_tokens=4096) is None


def test_thresholds_are_validated():
    with pytest.raises(ConfigError):
        PlacementConfig(tau_tokens=0)
