"""Model and task for a command, and a sweep's (clean, corrupt, metric); bad names or data
end the command in one line.
"""

from __future__ import annotations

from circuitkit.cli.checks import _positive
from circuitkit.cli.console import _errors_as_lines, _fail, echo
from circuitkit.experiments.characterize import DEFAULT_N


def _load(model: str | None, task: str, n_examples: int | None, seed: int, split: str,
          phase: int | None, loader=None, renders: bool = False, pairs: bool = False,
          corruption: str = "note", progress: bool = True):
    """(model, task) for a command; bad names or data end the command with one clear message.

    ``n_examples``: notes to build for a built-in task; for a ``.jsonl`` task, the first
    ``n_examples`` rows (None: all of them). ``model=None``: the task only. ``loader``: what
    loads the model (default ``ck.load_model``; its vocabulary is then checked, unless
    ``renders`` and the task is one the command renders as text for a pretrained LLM).
    ``phase``: None takes a file's own phase (a built-in's default: 2). ``pairs``: the command
    takes a file of plain clean/corrupt pairs (``tasks.pairs``): the "task" is then a
    ``Pairs``, its rows checked before the model loads and tokenized by it. ``corruption``:
    what the corrupt run edits (``load_task``'s option; "note", the default, is not passed).
    ``progress``: the command's ``--progress`` (False: transformers' loading bar off too).
    """
    import circuitkit as ck
    from circuitkit.models import ModelNotAvailableError, check_available, hf_progress
    from circuitkit.tasks import TOKENIZER_TASKS

    with _errors_as_lines(ModelNotAvailableError, FileNotFoundError, ValueError, OSError):
        _positive("--n-examples", n_examples, "notes in the run")
        if model is not None and loader is None:  # missing weights: said before torch loads
            check_available(model)
        file = task.endswith(".jsonl")  # its first n_examples rows (None: all)
        if pairs and file:
            from circuitkit.tasks import pairs as plain

            if plain.is_pairs_file(task):
                return _load_pairs(model, task, n_examples, phase, loader)
        n = n_examples if file else n_examples or DEFAULT_N
        options = {} if corruption == "note" else {"corruption": corruption}
        if task in TOKENIZER_TASKS and model is not None:  # text for the model's own tokenizer
            with hf_progress(progress):
                the_model = (loader or ck.load_model)(model)
            return the_model, ck.load_task(task, n_examples=n, seed=seed, split=split,
                                           phase=phase, tokenizer=the_model.tokenizer, **options)
        the_task = ck.load_task(task, n_examples=n, seed=seed, split=split, phase=phase,
                                **options)
        if model is None:
            return None, the_task
        with hf_progress(progress):  # --no-progress: transformers' bars too
            the_model = (loader or ck.load_model)(model)
        if loader is None:
            _check_vocabulary(the_model, the_task, renders)
        return the_model, the_task


def _load_pairs(model: str | None, task: str, n_examples: int | None, phase: int | None,
                loader=None):
    """(model, ``Pairs``) of a pairs file: its rows checked, then the model loaded and the
    prompts tokenized by it (``tasks.pairs``); ``_load``'s errors_as_lines words failures."""
    import circuitkit as ck
    from circuitkit.tasks import pairs as plain

    if phase is not None:
        raise ValueError(f"--phase {phase}: {task} holds plain clean/corrupt pairs, which have "
                         "no chain-of-thought phases; drop --phase.")
    rows = plain.read_pairs(task, n_examples)
    if model is None:
        raise ValueError(f"{task} holds plain clean/corrupt pairs, which the model's tokenizer "
                         "reads: run --plan where the weights are, or price prompts of one "
                         "length with --seq-len.")
    the_model = (loader or ck.load_model)(model)
    return the_model, plain.pairs_inputs(rows, the_model, name=task)


def _check_weights(model: str) -> None:
    """Weights that are not on this machine (and cannot be downloaded) end the command in one
    line before torch is imported (``models.check_available``): seconds, not a model load."""
    from circuitkit.models import ModelNotAvailableError, check_available

    with _errors_as_lines(ModelNotAvailableError, FileNotFoundError, ValueError):
        check_available(model)


def _check_vocabulary(model, task, renders: bool) -> None:
    """``task.check_model(model)``, except for a task ``_sweep_inputs`` renders as text for a
    model that does not read its word ids (a pretrained LLM): rendering re-tokenizes it, where
    the tokenizer reads the text without unknown tokens (``tasks.text.text_problem``; the rule
    ``score`` follows through ``scoring.text.load_for``)."""
    from circuitkit.tasks.text import needs_text, text_problem

    if not hasattr(task, "examples"):  # plain pairs: tokenized by this model's own tokenizer
        return
    tok = getattr(model, "tokenizer", None)
    if not (renders and needs_text(tok, task)):
        task.check_model(model)
        return
    problem = text_problem(task, tok)
    if problem:  # worded as load_for words it
        raise ValueError(f"task {task.name!r}: {task.vocabulary_problem(tok)} (Rendering the "
                         f"task as text for this model's tokenizer failed too: task "
                         f"{task.name!r} cannot be rendered as text for this model: {problem}.)")


def _sweep_inputs(tokenizer, the_task):
    """(clean, corrupt, metric, note) for a sweep. A CoT task (icd10, synthetic) given to a model
    whose tokenizer is not the task's word vocabulary (a pretrained LLM) is rendered as text
    (``tasks.text.text_prompts``: examples whose clean and corrupt texts differ in token count
    are dropped; metric: log-prob of the answer tokens); otherwise the task's own tokens."""
    from circuitkit.tasks.text import needs_text, text_prompts

    if not hasattr(the_task, "examples"):  # plain pairs (tasks.pairs): tokenized already
        return the_task.clean_tokens, the_task.corrupt_tokens, the_task.metric, ""
    if not needs_text(tokenizer, the_task):
        return the_task.clean_tokens, the_task.corrupt_tokens, the_task.metric, ""
    with _errors_as_lines():
        clean, corrupt, metric, kept = text_prompts(the_task, tokenizer)
    return clean, corrupt, metric, (
        f"{the_task.name} rendered as text for this model's tokenizer: {len(kept)} of "
        f"{len(the_task)} examples kept (clean and corrupt of equal token count); metric: "
        "log-prob of the answer tokens")


def _phase_task(the_task, name: str):
    """The examples with the task's phase's steps; a task without any: one line."""
    from circuitkit.tasks.base import phase_task, task_phases

    if not hasattr(the_task, "examples"):  # plain pairs (tasks.pairs): no phases
        return the_task
    if the_task.phase not in task_phases(the_task):
        _fail(f"task {name!r} has no Phase-{the_task.phase} steps "
              f"({'anchor_pos' if the_task.phase == 1 else 'answer_pos'} all empty): nothing to "
              f"patch; its phases: {task_phases(the_task) or 'none'} (--phase).")
    return phase_task(the_task, the_task.phase)


def _sweep_tokens(the_model, the_task):
    """(clean, corrupt, metric) of ``_sweep_inputs``, its note said on stderr."""
    clean, corrupt, metric, note = _sweep_inputs(the_model.tokenizer, the_task)
    if note:
        echo(note, err=True)
    return clean, corrupt, metric
