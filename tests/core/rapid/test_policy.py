"""RAPID's policy: the cost model's arithmetic, the decisions it makes from measured costs, and
that whatever it decides, the answer is the target's own (η = 0)."""

import pytest

from turborag_integrations.core.rapid.policy import (MARGIN, PROBE_GAMMA, CostTable, Costs,
                                                     SpeculationPolicy, expected_tokens,
                                                     predicted_speedup)
from turborag_integrations.core.settings import SpeculationConfig


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(4, 0.0) == 1.0  # every draft rejected: the target's token alone
    assert expected_tokens(4, 1.0) == 5.0
    assert expected_tokens(3, 0.5) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


def test_predicted_speedup_weighs_tokens_against_the_round_cost():
    # free drafting and verification: the round's tokens at the price of one step
    assert predicted_speedup(4, 1.0, step=1.0, draft=0.0, extra=0.0) == 5.0
    # drafting as dear as a target step, nothing accepted: γ + 1 steps for one token
    assert predicted_speedup(4, 0.0, step=1.0, draft=1.0, extra=0.0) == pytest.approx(1 / 5)


def decide(costs: Costs, max_gamma: int = 10) -> tuple[int, SpeculationPolicy]:
    policy = SpeculationPolicy("auto", max_gamma, costs)
    return policy.gamma_for(room=100), policy


def test_an_unmeasured_length_times_a_plain_step_then_a_small_round():
    costs = Costs()
    policy = SpeculationPolicy("auto", 10, costs)
    assert policy.gamma_for(100) == 0
    policy.observe(0, 0, 0.0, 0, verify_s=0.10)  # the plain step's time
    assert costs.step == 0.10
    assert policy.gamma_for(100) == PROBE_GAMMA
    policy.observe(2, 2, draft_s=0.004, draft_steps=2, verify_s=0.11)
    assert costs.draft == 0.002 and costs.extra == pytest.approx(0.005)
    gamma = policy.gamma_for(100)
    assert gamma > PROBE_GAMMA and policy.predicted > 1 + MARGIN  # cheap drafts, all accepted


def test_speculation_stays_off_once_it_predicts_a_loss():
    costs = Costs(step=0.10, draft=0.08, extra=0.01, accepted=1, rejected=9)
    gamma, policy = decide(costs)
    assert gamma == 0 and policy.off and policy.predicted < 1 + MARGIN
    costs.accepted = 1000  # even a later change of heart does not flip it within the answer
    assert policy.gamma_for(100) == 0
    assert policy.as_dict()["switched_off"] is True


def test_the_best_gamma_grows_with_acceptance_and_never_exceeds_the_cap_or_the_room():
    cheap = dict(step=0.10, draft=0.01, extra=0.002)
    low, _ = decide(Costs(**cheap, accepted=6, rejected=4))
    high, _ = decide(Costs(**cheap, accepted=95, rejected=5))
    assert 1 <= low < high <= 10
    policy = SpeculationPolicy("auto", 10, Costs(**cheap, accepted=95, rejected=5))
    assert policy.gamma_for(room=3) == 3


def test_always_drafts_gamma_every_round():
    policy = SpeculationPolicy("always", 7, Costs(step=0.1, draft=1.0, extra=1.0))
    assert [policy.gamma_for(100) for _ in range(3)] == [7, 7, 7]


def test_costs_are_kept_per_power_of_two_of_context():
    table = CostTable()
    assert table.at(3000) is table.at(4096) is not table.at(4097)
    assert CostTable.bucket(1) == 1 and CostTable.bucket(5000) == 8192


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="policy"):
        SpeculationConfig(policy="sometimes")


# ---- in an answer: whatever the policy decides, the answer is the target's own ---------------

@pytest.fixture
def pair(tmp_path):
    from tests.conftest import tiny_model
    from turborag_integrations.core.engine import TurboRAGEngine

    t = TurboRAGEngine(tiny_model("llama", seed=0), store=tmp_path / "kv", progress=False)
    d = TurboRAGEngine(tiny_model("llama", seed=1), store=tmp_path / "kv", progress=False)
    return t, d


def answer_with_costs(pair, costs: dict, n: int = 32):
    from tests.core.rapid.test_rapid import CONTEXT, PARAGRAPHS, QUESTION
    from turborag_integrations.core.rapid import RapidEngine, target_greedy
    from turborag_integrations.core.settings import GenerationConfig

    t, d = pair
    rapid = RapidEngine(t, d, gamma=6)  # policy "auto", the default
    prefix, suffix = rapid.render(t, CONTEXT, QUESTION)
    length = len(t.tokenizer(prefix + suffix, add_special_tokens=False)["input_ids"])
    seeded = rapid.costs.at(length)
    for name, value in costs.items():
        setattr(seeded, name, value)
    out = rapid.generate(CONTEXT, QUESTION, chunks=PARAGRAPHS[:1],
                         config=GenerationConfig(max_new_tokens=n))
    return out, target_greedy(t, prefix, suffix, n)


def test_where_speculation_pays_auto_speculates_and_stays_lossless(pair):
    out, reference = answer_with_costs(pair, dict(step=1.0, draft=0.01, extra=0.01,
                                                  accepted=50, rejected=1))
    assert out.token_ids == reference[:len(out.token_ids)]
    policy = out.stats.policy
    assert policy["policy"] == "auto" and policy["speculated_rounds"] >= 1
    assert out.stats.drafted > 0 and policy["speculated_rounds"] == out.stats.rounds


def test_where_it_does_not_pay_auto_decodes_with_the_target_alone(pair):
    out, reference = answer_with_costs(pair, dict(step=0.01, draft=1.0, extra=1.0,
                                                  accepted=1, rejected=50))
    assert out.token_ids == reference[:len(out.token_ids)]
    policy = out.stats.policy
    assert policy["switched_off"] and policy["speculated_rounds"] == 0
    # one plain step a token after the prefill's first (and one more for an end of sequence)
    assert out.stats.drafted == 0
    assert policy["plain_steps"] in (len(out.token_ids) - 1, len(out.token_ids))


def test_a_length_judged_a_loss_is_probed_again_now_and_then():
    from turborag_integrations.core.rapid.policy import REPROBE_EVERY

    costs = Costs(step=0.10, draft=0.08, extra=0.01, accepted=1, rejected=9)
    firsts = []
    for _ in range(2 * REPROBE_EVERY):
        policy = SpeculationPolicy("auto", 10, costs)
        firsts.append(policy.gamma_for(100))
        assert policy.gamma_for(100) == 0  # the costs still predict a loss
    assert firsts.count(PROBE_GAMMA) == 2 and firsts.count(0) == 2 * REPROBE_EVERY - 2
