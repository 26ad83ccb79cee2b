"""ZeRO-3's forward-count rule (dllm_rl/lockstep.py) in one process: every estimator declares exactly the network
forwards it makes (native model, and the LLaDA stand-in that runs one forward per span of real tokens), and a
rank that needs fewer than its peers makes up the difference with stand-in forwards that change nothing, not
the values, not the gradient, and that the backward runs through. Two ranks at ZeRO-3 against one process:
tests/engine/test_distributed.py."""

import itertools

import pytest
import torch

from dllm_rl import lockstep as lockstep_module
from dllm_rl.engine import World
from dllm_rl.likelihood.estimators import ESTIMATORS, LOGITS_CALLS, build_estimator
from dllm_rl.lockstep import Lockstep, counting_forwards
from dllm_rl.policy.adapters import load_policy
from dllm_rl.rollout.sampler import denoise, left_pad
from dllm_rl.seeds import row_generators
from tests.policy.remote_standins import write_llada

PROMPTS = ["12+7=", "3*4-5=", "9=", "3*4-5="]  # three prompt lengths: three spans for LLaDA
OPTIONS = {"mean_field": {}, "elbo": {"num_masks": 2}, "coupled": {"num_masks": 2}, "ordered": {"group": 3},
           "left_to_right": {"group": 4}, "espo": {"num_masks": 2}, "spg": {"num_masks": 2, "block_length": 8}}
COUNTER = itertools.count()


@pytest.fixture(scope="module")
def llada(tmp_path_factory, char_tokenizer):
    path = write_llada(tmp_path_factory.mktemp("llada") / f"llada_{next(COUNTER)}", char_tokenizer)
    return load_policy(str(path), trust_remote_code=True)[0]


def rollouts(policy, tokenizer, threshold=0.3):
    """Padded rows with the unmask steps of confidence-parallel decoding (data-dependent step counts)."""
    ids, mask = left_pad([tokenizer(t, add_special_tokens=False)["input_ids"] for t in PROMPTS], tokenizer.pad_token_id)
    out = denoise(policy, ids, mask, gen_length=16, block_length=8, steps=4, temperature=1.0, threshold=threshold,
                  generators=row_generators([1, 2, 3, 4]))
    return out.sequences_BL, out.attention_mask_BL, ids.shape[1], out.unmask_step_BC


def test_every_estimator_has_a_declared_count():
    assert set(LOGITS_CALLS) == set(ESTIMATORS)


@pytest.mark.parametrize("name", sorted(OPTIONS))
@pytest.mark.parametrize("kind", ["native", "llada"])
def test_each_estimator_makes_exactly_the_forwards_it_declares(name, kind, tiny_policy, llada, char_tokenizer):
    policy = tiny_policy if kind == "native" else llada
    ids, mask, P, order = rollouts(policy, char_tokenizer)
    estimator = build_estimator({"name": name, **OPTIONS[name]})
    for rows in ([0, 1, 2, 3], [1, 3], [2]):  # three spans, one span
        declared = estimator.forwards(policy, mask[rows], P, order[rows])
        with counting_forwards(policy.model) as made, torch.no_grad():
            estimator.logp(policy, ids[rows], mask[rows], P, seeds_N=[5] * len(rows), order_NC=order[rows],
                           adv_N=torch.linspace(-1, 1, len(rows)))
        assert made[0] == declared, (name, kind, rows)
    spans = policy.forwards(mask)
    assert spans == (3 if kind == "llada" else 1)


def test_a_rank_that_needs_fewer_forwards_makes_the_rest_and_nothing_changes(tiny_policy, char_tokenizer, monkeypatch):
    """A peer needs 9 forwards where this rank's rows need fewer: the rank makes 9, its values and gradients are
    those of the plain estimator, and the stand-in forwards are part of the backward graph."""
    ids, mask, P, order = rollouts(tiny_policy, char_tokenizer)
    estimator = build_estimator({"name": "ordered", "group": 2})
    args = (tiny_policy, ids, mask, P, [7] * 4, order, torch.ones(4, 16))
    lockstep = Lockstep(World(0, 2), enabled=True)
    monkeypatch.setattr(lockstep_module, "all_max", lambda values, world: [9.0])
    own = estimator.forwards(tiny_policy, mask, P, order)
    assert own < 9
    net = tiny_policy.model.train()
    plain, _ = estimator.score(*args)
    plain.sum().backward()
    plain_grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    backward_calls = [0]
    head = [m for m in net.modules() if isinstance(m, torch.nn.Linear)][-1]  # a module that returns a tensor
    handle = head.register_full_backward_hook(lambda *_: backward_calls.__setitem__(0, backward_calls[0] + 1))
    with counting_forwards(net) as made:
        stepped, _ = lockstep.score(estimator, *args)
    assert made[0] == 9 and torch.equal(stepped, plain)
    stepped.sum().backward()
    handle.remove()
    assert backward_calls[0] == 9  # the backward went through every forward, the stand-ins' too
    assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), plain_grads))
    with torch.no_grad(), counting_forwards(net) as made:
        assert torch.equal(lockstep.score(estimator, *args)[0], plain.detach())
    assert made[0] == 9


def test_a_wrong_declaration_is_an_error_not_a_hang(tiny_policy, char_tokenizer, monkeypatch):
    ids, mask, P, order = rollouts(tiny_policy, char_tokenizer)
    monkeypatch.setitem(LOGITS_CALLS, "mean_field", lambda order_NC, C, options: 2)
    monkeypatch.setattr(lockstep_module, "all_max", lambda values, world: values)
    with pytest.raises(RuntimeError, match="'mean_field' estimator declared 2 forwards of a native model and made 1"):
        Lockstep(World(0, 2), enabled=True).score(build_estimator({"name": "mean_field"}), tiny_policy, ids, mask, P,
                                                  [1] * 4, order, torch.ones(4, 16))


def test_one_process_and_low_stages_need_no_lockstep():
    assert not Lockstep(World(), enabled=True).enabled and not Lockstep(World(0, 2), enabled=False).enabled
