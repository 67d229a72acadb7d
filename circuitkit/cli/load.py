"""Model and task for a command, and a sweep's (clean, corrupt, metric); bad names or data
end the command in one line.
"""

from __future__ import annotations

import typer

from circuitkit.characterize import DEFAULT_N
from circuitkit.cli.checks import _positive
from circuitkit.cli.console import _errors_as_lines, _fail


def _load(model: str | None, task: str, n_examples: int | None, seed: int, split: str,
          phase: int | None, loader=None, renders: bool = False):
    """(model, task) for a command; bad names or data end the command with one clear message.

    ``n_examples``: notes to build for a built-in task; for a ``.jsonl`` task, the first
    ``n_examples`` rows (None: all of them). ``model=None``: the task only. ``loader``: what
    loads the model (default ``ck.load_model``; its vocabulary is then checked, unless
    ``renders`` and the task is one the command renders as text for a pretrained LLM).
    ``phase``: None takes a file's own phase (a built-in's default: 2).
    """
    import circuitkit as ck
    from circuitkit.models import ModelNotAvailableError
    from circuitkit.tasks import TOKENIZER_TASKS

    with _errors_as_lines(ModelNotAvailableError, FileNotFoundError, ValueError, OSError):
        _positive("--n-examples", n_examples, "notes in the run")
        file = task.endswith(".jsonl")  # its first n_examples rows (None: all)
        n = n_examples if file else n_examples or DEFAULT_N
        if task in TOKENIZER_TASKS and model is not None:  # text for the model's own tokenizer
            the_model = (loader or ck.load_model)(model)
            return the_model, ck.load_task(task, n_examples=n, seed=seed, split=split,
                                           phase=phase, tokenizer=the_model.tokenizer)
        the_task = ck.load_task(task, n_examples=n, seed=seed, split=split, phase=phase)
        if model is None:
            return None, the_task
        the_model = (loader or ck.load_model)(model)
        if loader is None:
            _check_vocabulary(the_model, the_task, renders)
        return the_model, the_task


def _check_vocabulary(model, task, renders: bool) -> None:
    """``task.check_model(model)``, except for a task ``_sweep_inputs`` renders as text for a
    model that does not read its word ids (a pretrained LLM): rendering re-tokenizes it, where
    the tokenizer reads the text without unknown tokens (``tasks.text.text_problem``; the rule
    ``score`` follows through ``scoring.text.load_for``)."""
    from circuitkit.tasks.text import needs_text, text_problem

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

    if the_task.phase not in task_phases(the_task):
        _fail(f"task {name!r} has no Phase-{the_task.phase} steps "
              f"({'anchor_pos' if the_task.phase == 1 else 'answer_pos'} all empty): nothing to "
              f"patch; its phases: {task_phases(the_task) or 'none'} (--phase).")
    return phase_task(the_task, the_task.phase)


def _sweep_tokens(the_model, the_task):
    """(clean, corrupt, metric) of ``_sweep_inputs``, its note said on stderr."""
    clean, corrupt, metric, note = _sweep_inputs(the_model.tokenizer, the_task)
    if note:
        typer.echo(note, err=True)
    return clean, corrupt, metric
