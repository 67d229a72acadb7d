"""Teacher-signal store: shards + manifest, refused on any mismatch, store-backed losses equal the
on-the-fly ones, deterministic resumable batch streams."""

from __future__ import annotations

import json
import os

import pytest
import torch
from distill_helpers import TEACHER_P1, TEACHER_P2, TINY_STUDENT, hand_scores

import circuitkit as ck
from circuitkit.distill import loss as L
from circuitkit.distill import signals as S


@pytest.fixture(scope="module")
def teacher():
    return ck.load_model("icd-teacher")


@pytest.fixture(scope="module")
def pool():
    return ck.load_task("icd10", n_examples=20, seed=4, split="train")


@pytest.fixture(scope="module")
def scores():
    return hand_scores(4, 8, TEACHER_P1, TEACHER_P2)


@pytest.fixture(scope="module")
def store(teacher, pool, scores, tmp_path_factory):
    out = tmp_path_factory.mktemp("store")
    return S.build_store(teacher, pool, scores, out, S.StoreOptions(shard_size=8, topk_logits=3),
                         teacher_name="icd-teacher", progress=False)


def test_store_layout_and_manifest(store, teacher, pool, scores):
    man = json.loads((store.path / S.MANIFEST).read_text())
    assert [s["n_examples"] for s in man["shards"]] == [8, 8, 4]
    assert man["teacher_fingerprint"] == S.model_fingerprint(teacher)
    assert man["scores_hash"] == S.scores_hash(scores)
    assert man["task_fingerprint"] == pool.fingerprint()
    assert man["bytes"] == sum(os.path.getsize(store.path / s["file"]) for s in man["shards"])
    assert not (store.path / S.PARTIAL).exists()
    d = store.shard(0)
    assert d["p1_attn"].dtype == torch.float32 and d["tokens"].shape[0] == 8
    # the stored CoT is the teacher's greedy chain (through the bridge, no cache)
    rows, mask = S.teacher_rows(teacher, pool.subset(range(8)))
    n = d["tokens"].shape[1]
    assert torch.equal(d["tokens"].long(), rows[:, :n]) and torch.equal(d["mask"].bool(),
                                                                       mask[:, :n])
    # opening again (same spec) and building again (finished) both work
    again = S.build_store(teacher, pool, scores, store.path, S.StoreOptions(shard_size=8,
                                                                            topk_logits=3),
                          progress=False)
    assert again.manifest == store.manifest


def test_mismatched_store_is_refused(store, teacher, pool, scores):
    opts = S._options_dict(S.StoreOptions(shard_size=8, topk_logits=3))
    good = S.StoreSpec(S.model_fingerprint(teacher), S.scores_hash(scores), pool.fingerprint(),
                       opts)
    S.SignalStore.open(store.path, good)
    other = ck.load_model("icd-student-cot")
    for field, spec in (
            ("teacher_fingerprint", S.StoreSpec(S.model_fingerprint(other), good.scores,
                                                good.task, opts)),
            ("scores_hash", S.StoreSpec(good.teacher, S.scores_hash(
                hand_scores(4, 8, {(1, 1): 1.0}, TEACHER_P2)), good.task, opts)),
            ("task_fingerprint", S.StoreSpec(good.teacher, good.scores,
                                             pool.subset(range(10)).fingerprint(), opts)),
            ("options", S.StoreSpec(good.teacher, good.scores, good.task,
                                    {**opts, "top_k1": 3}))):
        with pytest.raises(ValueError, match=f"does not match this run.*{field}"):
            S.SignalStore.open(store.path, spec)
    with pytest.raises(ValueError, match="does not match this run.*scores_hash"):
        S.build_store(teacher, pool, hand_scores(4, 8, {(1, 1): 1.0}, TEACHER_P2), store.path,
                      S.StoreOptions(shard_size=8, topk_logits=3), progress=False)


def test_unfinished_store_is_named_and_resumed(teacher, pool, scores, tmp_path):
    out = tmp_path / "s"
    opts = S.StoreOptions(shard_size=8, nonselective=False)
    full = S.build_store(teacher, pool, scores, out, opts, progress=False)
    first = (out / "shard-00000.safetensors").read_bytes()
    # as if killed after shard 0: the manifest was never written, shard 1 and 2 missing
    (out / S.MANIFEST).unlink()
    (out / "shard-00001.safetensors").unlink()
    (out / "shard-00002.safetensors").unlink()
    from circuitkit.files import write_json

    head = {k: v for k, v in full.manifest.items() if k not in ("shards", "n_examples",
                                                                 "bytes")}
    write_json(out / S.PARTIAL, dict(head, shards=full.manifest["shards"][:1]))  # as written
    with pytest.raises(ValueError, match="not a finished teacher-signal store.*interrupted"):
        S.SignalStore.open(out)
    with pytest.raises(ValueError, match="partly built signal store for another"):
        S.build_store(teacher, pool, hand_scores(4, 8, {(1, 1): 1.0}, TEACHER_P2), out, opts,
                      progress=False)
    again = S.build_store(teacher, pool, scores, out, opts, progress=False)
    assert (out / "shard-00000.safetensors").read_bytes() == first  # kept, not recomputed
    assert again.manifest["shards"] == full.manifest["shards"]


def test_store_backed_losses_equal_on_the_fly_losses(store, teacher, pool, scores):
    tiny = ck.load_model(dict(TINY_STUDENT))
    idx = [5, 1, 6]
    batch = store.batch(0, idx)
    cfg = L.LossConfig(topk_logits=3, kd_weight=0.5)
    got = L.student_terms(tiny, batch, store.pooling(), store.anchors, cfg, 1.0, 1.0, 1.0)
    sub = pool.subset(idx)
    rows, mask = S.teacher_rows(teacher, sub)
    ref = L.losses(teacher, tiny, sub, scores, cot=(rows, mask), lambda_ns=1.0, config=cfg)
    for k in ("cot", "p1", "p2", "ns", "total"):
        assert got[k].item() == pytest.approx(ref[k].item(), rel=1e-5, abs=1e-6), k
    assert got["cot"].item() > L.loss_cot(tiny(batch.tokens), batch.tokens, batch.mask, None,
                                          cfg).item()  # the KD term is on


def test_batch_stream_is_a_function_of_seed_and_step(store):
    a, b = S.BatchStream(store, 4, seed=7), S.BatchStream(store, 4, seed=7)
    assert a.per_epoch == 2 + 2 + 1
    for i in (0, 3, 4, 9, 12):
        x, y = a[i], b[i]
        assert torch.equal(x.tokens, y.tokens) and torch.equal(x.teacher.p1_attn,
                                                               y.teacher.p1_attn)
    seen = [a.locate(i) for i in range(a.per_epoch)]
    per_shard: dict[int, list[int]] = {}
    for shard, idx in seen:
        per_shard.setdefault(shard, []).extend(idx)
    assert all(len(v) == len(set(v)) for v in per_shard.values())  # no repeats in an epoch
    assert sorted(len(v) for v in per_shard.values()) == [4, 8, 8]
    assert S.BatchStream(store, 4, seed=8).locate(0) != a.locate(0) or \
        S.BatchStream(store, 4, seed=8).locate(1) != a.locate(1)
    with pytest.raises(ValueError, match="batch_size 9 is larger than every shard"):
        S.BatchStream(store, 9, seed=0)


def test_store_of_a_teacher_without_cot_steps_warns(pool, tmp_path):
    untrained = ck.load_model(TINY_STUDENT)  # random weights: its greedy output has no <think>
    scores = hand_scores(2, 4, {(0, 0): 1.0}, {(1, 0): 1.0})
    with pytest.warns(UserWarning, match="answer steps, so (L_P1 and )?L_P2 will be 0"):
        S.build_store(untrained, pool.subset(range(3)), scores, tmp_path / "s",
                      S.StoreOptions(shard_size=2), progress=False)


def test_the_store_fingerprints_its_teacher_as_checkpoints_do(store, teacher, pool, scores,
                                                              tmp_path):
    """One model fingerprint: the store's ``teacher_fingerprint`` is
    ``identity.model_fingerprint`` (the checkpoints' and result files'); a store written before
    (format /4: the store's own hash of the weights) is refused in one line naming what changed
    and the folder to delete; ``teacher_folder`` compares the weights themselves."""
    import shutil

    from circuitkit import identity
    from circuitkit.models import plain_parameters

    assert S.model_fingerprint is identity.model_fingerprint
    assert store.manifest["teacher_fingerprint"] == identity.model_fingerprint(teacher)
    old = tmp_path / "old"
    shutil.copytree(store.path, old)
    man = json.loads((old / S.MANIFEST).read_text())
    (old / S.MANIFEST).write_text(json.dumps(dict(man, format="circuitkit.distill.signals/4")))
    with pytest.raises(S.StoreProblem, match=r"field 'format' is 'circuitkit.distill.signals/4'"
                       r".*identity.model_fingerprint.*delete the folder") as e:
        S.SignalStore.open(old)
    assert "\n" not in str(e.value)
    with pytest.raises(S.StoreProblem, match="identity.model_fingerprint"):  # the build says it
        S.build_store(teacher, pool, scores, old, S.StoreOptions(shard_size=8, topk_logits=3),
                      progress=False)
    edited = ck.load_model("icd-teacher")
    assert S.teacher_folder(edited) is not None  # its shipped folder holds these weights
    with torch.no_grad():
        next(iter(plain_parameters(edited).values())).view(-1)[0] += 1.0
    assert S.teacher_folder(edited) is None
    assert identity.model_fingerprint(edited) != identity.model_fingerprint(teacher)
