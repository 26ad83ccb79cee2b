"""Speculative sampling from a causal LM with tree drafts (SRT): exact against plain sampling, and the
accept/reject rule checked exhaustively on a toy vocabulary."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from dllm_rl.rollout.causal import accepted_drafts, choose_tokens, sample_causal, sample_speculative
from dllm_rl.rollout.sampler import first_eos, left_pad
from dllm_rl.rollout.speculative import DraftForest, DraftTree
from dllm_rl.seeds import row_generators

EOS = 2


def tiny_qwen(vocab: int, seed: int = 0, sharpen: float = 1.0) -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                         pad_token_id=0, eos_token_id=EOS, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    return model


@pytest.fixture(scope="module")
def model():
    return tiny_qwen(40, sharpen=3.0)


def random_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def drafter_of(trees, k):
    return lambda row, tokens: trees[row].draft(tokens, k, stop=EOS)


# ------------------------------------------------------------------------------------------------ the tree


def test_tree_drafts_the_most_frequent_continuation_of_the_longest_match():
    tree = DraftTree(match=2, history=8)
    tree.insert([5, 6, 7, EOS])
    tree.insert([5, 6, 8, EOS])
    tree.insert([5, 6, 8, EOS])
    assert tree.draft([], 3) == [5, 6, 8]  # from the start: 5, then 6, then 8 (2 of 3 rollouts)
    assert tree.draft([5, 6], 5, stop=EOS) == [8, EOS]  # stops after the EOS
    assert tree.draft([9, 9], 2) == []  # no context matches
    tree.insert([9, 7, 3])
    assert tree.draft([4, 7], 1) == [EOS]  # only (7,) matches: EOS once, 3 once; the tie goes to the smaller id
    tree.insert([9, 7, 3])
    assert tree.draft([4, 7], 1) == [3]  # now 3 twice
    assert tree.draft([1, 6, 7], 1) == [EOS]  # the longest match (6, 7) -> EOS wins over the more frequent (7,) -> 3


def test_tree_anchors_early_contexts_at_the_start_and_forgets_beyond_its_history():
    tree = DraftTree(match=3, history=2)
    tree.insert([4, 4, 9])
    assert tree.draft([4], 1) == [4] and tree.draft([7, 4], 1) == [4]
    tree.insert([1, 2, 3])
    tree.insert([1, 2, 5])  # the first rollout leaves
    assert len(tree) == 2 and tree.draft([], 1) == [1]
    assert tree.draft([4, 4], 1) == []  # its contexts are gone, counts and keys both
    assert all(counts for counts in tree.next.values())
    assert tree.next[(-1,)] == {1: 2}


def test_the_forest_drops_the_least_recently_used_trees_past_its_capacity():
    forest = DraftForest(match=2, history=2, capacity=10)
    forest.insert("a", [5, 6, 7])
    forest.insert("b", [5, 6, 8, EOS])
    assert forest.tokens == 7 and list(forest.trees) == ["a", "b"]
    forest.tree("a")  # drafting from a's tree makes it the most recently used
    forest.insert("c", [9, 9, 9])  # 10 tokens: at capacity, nothing dropped
    assert forest.tokens == 10 and list(forest.trees) == ["b", "a", "c"]
    forest.insert("c", [1])  # 11 > 10: b, the least recently used, goes
    assert list(forest.trees) == ["a", "c"] and forest.tokens == 7
    forest.insert("c", [2, 2])  # c holds its last 2 rollouts only (history): [1], [2, 2]
    assert forest.trees["c"].tokens == 3 and forest.tokens == 6
    forest.insert("d", [3] * 12)  # one tree over capacity alone: the others go, it stays (history bounds it)
    assert list(forest.trees) == ["d"] and forest.tokens == 12
    assert forest.tree("e").draft([], 2) == [] and len(forest) == 2  # a new prompt starts with an empty tree


def test_choose_tokens_and_accepted_drafts_by_hand():
    logits = torch.log(torch.tensor([[[0.2, 0.5, 0.3]]]))
    for u, expected in ((0.1, 0), (0.2, 1), (0.69, 1), (0.71, 2), (0.999, 2)):
        token, prob = choose_tokens(logits, 1.0, torch.tensor([[u]], dtype=torch.float64))
        assert token.item() == expected and prob.item() == pytest.approx([0.2, 0.5, 0.3][expected])
    token, prob = choose_tokens(logits, 0.0, None)
    assert token.item() == 1 and prob.item() == pytest.approx(0.5)
    tokens = torch.tensor([[4, 5, 6, 7], [4, 9, 6, 7], [1, 2, 3, 4]])
    drafts = torch.tensor([[4, 5, 6], [4, 5, 6], [1, 2, 0]])
    has = torch.tensor([[True, True, True], [True, True, True], [True, True, False]])
    assert accepted_drafts(tokens, drafts, has).tolist() == [3, 1, 2]


# ------------------------------------------------------------------------------------- exact sampling


def test_greedy_equals_plain_generation_whatever_the_tree(model):
    prompts = random_prompts(6, 40, seed=1)
    ids, mask = left_pad(prompts, 0)
    plain = sample_causal(model, ids, mask, max_new_tokens=24, eos_id=EOS)
    reference = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                               eos_token_id=EOS, pad_token_id=EOS)
    assert torch.equal(plain.sequences_BL[:, : reference.shape[1]], reference)
    g = torch.Generator().manual_seed(3)
    for source in ("own", "junk", "empty"):
        trees = [DraftTree(match=3) for _ in prompts]
        for b, tree in enumerate(trees):
            if source == "own":  # earlier rollouts that agree with this one for a while
                tree.insert(plain.completion_BC[b, :12].tolist())
            elif source == "junk":
                tree.insert(torch.randint(3, 40, (24,), generator=g).tolist())
        spec, stats = sample_speculative(model, ids, mask, max_new_tokens=24, eos_id=EOS,
                                         drafter=drafter_of(trees, 5), draft_tokens=5)
        assert torch.equal(spec.sequences_BL, plain.sequences_BL), source
        torch.testing.assert_close(spec.confidence_BC, plain.confidence_BC, rtol=1e-4, atol=1e-6)
        assert stats.emitted == int((plain.completion_BC != EOS).sum() + (plain.completion_BC == EOS).any(-1).sum())
        if source == "own":
            assert stats.accepted >= 6 * 10 and stats.emitted / stats.row_forwards > 2
        if source == "empty":
            assert stats.drafted == 0 and stats.emitted == stats.row_forwards


def test_sampled_output_does_not_depend_on_drafts_or_batch(model):
    prompts = random_prompts(5, 40, seed=2)
    ids, mask = left_pad(prompts, 0)
    seeds = [11, 12, 13, 14, 15]
    plain, plain_stats = sample_speculative(model, ids, mask, max_new_tokens=20, eos_id=EOS, temperature=0.8,
                                            generators=row_generators(seeds))
    assert plain_stats.accepted == 0 and plain_stats.emitted == plain_stats.row_forwards
    trees = [DraftTree() for _ in prompts]
    for round_ in range(3):  # the tree learns from each round; the rows stay the same
        spec, stats = sample_speculative(model, ids, mask, max_new_tokens=20, eos_id=EOS, temperature=0.8,
                                         generators=row_generators(seeds), drafter=drafter_of(trees, 4), draft_tokens=4)
        assert torch.equal(spec.sequences_BL, plain.sequences_BL)
        torch.testing.assert_close(spec.confidence_BC, plain.confidence_BC, rtol=1e-4, atol=1e-6)
        for b, tree in enumerate(trees):
            tree.insert(spec.completion_BC[b].tolist())
    assert stats.accepted / stats.drafted == 1.0  # the tree holds this very rollout by the third round
    assert first_eos(plain.completion_BC, EOS).tolist() == [14, 17, 20, 20, 20]  # two rows leave the batch early
    for b in range(len(prompts)):
        one_ids, one_mask = left_pad([prompts[b]], 0)
        one, _ = sample_speculative(model, one_ids, one_mask, max_new_tokens=20, eos_id=EOS, temperature=0.8,
                                    generators=row_generators([seeds[b]]), drafter=drafter_of([trees[b]], 3),
                                    draft_tokens=3)
        assert torch.equal(one.completion_BC[0], plain.completion_BC[b])


def test_finished_rows_stay_in_the_batch_where_the_cache_cannot_drop_them(model, monkeypatch):
    from transformers.cache_utils import Cache

    prompts = random_prompts(5, 40, seed=2)
    ids, mask = left_pad(prompts, 0)
    trees = [DraftTree() for _ in prompts]
    run = lambda: sample_speculative(model, ids, mask, max_new_tokens=20, eos_id=EOS, temperature=0.8,  # noqa: E731
                                     generators=row_generators([11, 12, 13, 14, 15]), drafter=drafter_of(trees, 4),
                                     draft_tokens=4)
    dropped, _ = run()
    for b, tree in enumerate(trees):
        tree.insert(dropped.completion_BC[b, :9].tolist())
    dropped, dropped_stats = run()
    monkeypatch.delattr(Cache, "batch_select_indices")
    kept, kept_stats = run()
    assert torch.equal(kept.sequences_BL, dropped.sequences_BL) and kept_stats == dropped_stats


# ---------------------------------------------------------------------- the accept/reject rule, exhaustively


def next_token_probs(model, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """p(. | prompt + tokens) at `temperature`, by a full forward without cache (float64)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, -1].double()
    return torch.softmax(logits / temperature, -1)


def standard_rule(model, prompt, tree, k, C, temperature):
    """The textbook speculative sampling rule in probability space, for a draft q (here the tree's point mass):
    accept draft d with probability min(1, p(d) / q(d)), else emit a token of max(p - q, 0) normalised; after a
    fully accepted draft, one token from p. Returns {outcome: probability} and the expected accepted drafts."""
    outcomes, expected_accepted = {}, 0.0

    def finished(tokens):
        return tokens[-1] == EOS or len(tokens) == C

    def walk(tokens, prob, accepted):
        nonlocal expected_accepted
        if finished(tokens):
            outcomes[tuple(tokens)] = outcomes.get(tuple(tokens), 0.0) + prob
            expected_accepted += prob * accepted
            return
        draft = tree.draft(tokens, min(k, C - len(tokens) - 1), stop=EOS)
        reach, current = prob, list(tokens)
        for j, d in enumerate(draft):
            p = next_token_probs(model, prompt, current, temperature)
            q = torch.zeros_like(p)
            q[d] = 1.0
            accept = min(1.0, float(p[d] / q[d]))
            residual = (p - q).clamp(min=0)
            if residual.sum() > 0:
                residual = residual / residual.sum()
                for x in range(len(p)):
                    walk(current + [x], reach * (1 - accept) * float(residual[x]), accepted + j)
            reach, current = reach * accept, current + [d]
            if d == EOS:
                return walk(current, reach, accepted + j + 1)
        p = next_token_probs(model, prompt, current, temperature)
        for x in range(len(p)):
            walk(current + [x], reach * float(p[x]), accepted + len(draft))

    first = next_token_probs(model, prompt, [], temperature)
    for x in range(len(first)):
        walk([x], float(first[x]), 0)
    return outcomes, expected_accepted


def uniforms_for(model, prompt, outcome, C, temperature) -> torch.Tensor:
    """The uniform numbers at the middle of each token's CDF interval along `outcome` (0.5 past its end)."""
    u = [0.5] * C
    for t, token in enumerate(outcome):
        p = next_token_probs(model, prompt, list(outcome[:t]), temperature)
        lo = float(p[:token].sum())
        u[t] = lo + float(p[token]) / 2
    return torch.tensor([u], dtype=torch.float64)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_accept_reject_rule_preserves_the_distribution_exhaustively(temperature):
    V, C, k = 4, 4, 3  # tokens 0..3 (EOS = 2); every outcome of 4 tokens enumerated
    model = tiny_qwen(V, seed=5, sharpen=8.0)
    prompt = [1, 3, 0, 3]
    tree = DraftTree(match=2)
    for rollout in ([3, 3, 1, EOS], [3, 1, 1, 0], [0, 3, EOS], [3, 3, 0, 1]):
        tree.insert(rollout)
    likely = standard_rule(model, prompt, DraftTree(), k, C, temperature)[0]
    for rollout in sorted(likely, key=likely.get)[-8:]:  # and the 8 likeliest outcomes, the likeliest last
        tree.insert(list(rollout))
    outcomes, expected_accepted = standard_rule(model, prompt, tree, k, C, temperature)
    # the rule's output distribution is the model's own: every outcome with its probability under p
    assert sum(outcomes.values()) == pytest.approx(1.0, abs=1e-12)
    for outcome, prob in outcomes.items():
        p = 1.0
        for t, token in enumerate(outcome):
            p *= float(next_token_probs(model, prompt, list(outcome[:t]), temperature)[token])
        assert prob == pytest.approx(p, rel=1e-9, abs=1e-15)
    # the sampler, fed the uniform that lands on each outcome, writes exactly that outcome; its accepted drafts,
    # weighted by the outcomes' probabilities, are what the rule expects
    ids, mask = left_pad([prompt], 0)
    measured_accepted = 0.0
    for outcome, prob in outcomes.items():
        samples, stats = sample_speculative(model, ids, mask, max_new_tokens=C, eos_id=EOS, temperature=temperature,
                                            drafter=drafter_of([tree], k), draft_tokens=k,
                                            uniform_BC=uniforms_for(model, prompt, outcome, C, temperature))
        written = samples.completion_BC[0].tolist()
        assert written == list(outcome) + [EOS] * (C - len(outcome))
        measured_accepted += prob * stats.accepted
    assert expected_accepted > 0.3  # the tree's drafts are often right, so the rule is exercised both ways
    assert measured_accepted == pytest.approx(expected_accepted, rel=1e-9)
