"""dropless-train (python -m dropless.train): train from Hydra overrides.

Usage:

    dropless-train [KEY=VALUE ...] [recipe=NAME] [--cfg [job]] [--help]

    dropless-train                                   # CPU default: tiny MoE on the stdlib's text
    dropless-train train.steps=20 run_dir=runs/try   # fewer steps, a chosen run directory
    dropless-train recipe=h200_single                # a complete experiment from recipes/
    torchrun --nproc_per_node 4 -m dropless.train dispatcher=a2a
    dropless-train resume=true run_dir=runs/try      # continue from the newest checkpoint
    torchrun --max-restarts 1 --nproc_per_node 2 -m dropless.train run_dir=runs/try
                                                     # a restart after a failure resumes by itself

--cfg (or Hydra's --cfg job) checks the config on its own (ranges, the model, the data fields and
that the data paths exist) and prints it resolved, then exits; the checks that need the machine
(device, the data's contents, run directory) run at start.
Exit status: 0 done, 1 a peer rank died or stopped taking part (the message names
train.dist_timeout_s, within which it comes), 2 bad config or data (the message names the
field; also a step or a model that does not fit in GPU memory: the message says what to lower),
3 training diverged (a non-finite loss, gradient norm or validation loss with
train.nonfinite=error, the message names the step; with train.nonfinite=skip, at the end, a run
whose validation loss went non-finite, whose every step was skipped, or whose last step was
skipped with train.val_every=0; the message counts the skipped steps), 130 stopped by Ctrl-C
(SIGINT/SIGTERM) after saving a checkpoint, or during start-up (nothing trained or saved), or
aborted by a second Ctrl-C without that checkpoint (the message names the step to resume from).
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

__all__ = ["main"]


def _usage() -> str:
    from dropless.train.config import list_recipes

    return (__doc__ or "") + "\nRecipes: " + ", ".join(list_recipes()) + "\n"


def _out_of_memory(cfg, when: str, err: BaseException, newest: tuple[int, Any] | None = None) -> str:
    """The error line for ``torch.OutOfMemoryError`` (the GPU's allocator) ``when`` ("at step N" or
    "during start-up"): the allocator's first three sentences (what it asked for, the GPU's total and
    free memory), the settings that lower the peak and where a resume would start (``newest``: the run's
    newest complete checkpoint ``(step, path)``, or None)."""
    first = ". ".join(str(err).strip().split("\n")[0].split(". ")[:3]).rstrip(".")
    t = cfg.train
    if when == "during start-up":
        fix = ("the weights, gradients and optimizer state do not fit beside what start-up allocates: shard "
               "them over more GPUs (dispatcher=fsdp, or expert parallelism with torchrun) or train a smaller "
               "model")
    else:
        fix = (f"lower train.micro_batch_size (now {int(t.micro_batch_size)}; raise train.grad_accum, now "
               f"{int(t.grad_accum)}, to keep the tokens per step) or train.seq_len (now {int(t.seq_len)}), or "
               "set train.activation_checkpointing=true or the MoE memory options model.recompute_fc1, "
               "model.recompute_gather, model.fold_routing_weights, model.num_token_chunks (dropless-plan lists "
               "what each keeps for backward)")
    if when == "during start-up":
        after = "nothing was trained or saved"
    elif newest is None:
        after = "no checkpoint was saved before it, so a new run starts from step 0"
    else:
        after = f"this step was not saved; resume=true continues from {newest[1].name} (step {newest[0]})"
    return f"out of GPU memory {when} ({first}): {fix}; {after}"


def _restarts_note() -> str:
    """Under ``torchrun --max-restarts N``, for an error that every restart meets again: which start
    this was and that the restarts will end the same way."""
    import os

    most = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if most <= 0:
        return ""
    done = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    left = max(0, most - done)
    return (f" [torchrun start {done + 1} of at most {most + 1}: a restart meets this error again"
            + (f"; stop the job (Ctrl-C) instead of waiting for the {left} restart(s) left]" if left else "]"))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point. ``argv``: Hydra overrides (default ``sys.argv[1:]``). Returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before the trainer's handler is installed (imports, config, data, model)
        print("dropless-train: interrupted during start-up, before the first step: nothing was trained or saved",
              file=sys.stderr, flush=True)
        return 130


def _main(argv: list[str]) -> int:
    parsed = _parse_args(argv)
    if isinstance(parsed, int):
        return parsed
    started = _start(*parsed)
    if isinstance(started, int):
        return started
    return _train(*started)


def _parse_args(argv: list[str]) -> tuple[list[str], bool] | int:
    """``(overrides, show_cfg)`` from the command line, or the exit status (``--help``, a bad option)."""
    # --cfg=job is argparse's spelling of --cfg job
    argv = [x for a in argv for x in (a.split("=", 1) if a.startswith("--cfg=") else [a])]
    if any(a in ("-h", "--help") for a in argv):
        print(_usage())
        return 0
    show_cfg = "--cfg" in argv
    if show_cfg:  # Hydra apps spell it --cfg job|hydra|all: job and all are the one config there is here
        i = argv.index("--cfg")
        if i + 1 < len(argv) and argv[i + 1] in ("job", "all"):
            del argv[i + 1]
        elif i + 1 < len(argv) and "=" not in argv[i + 1] and not argv[i + 1].startswith(("-", "~")):
            print(f"dropless-train: --cfg {argv[i + 1]}: unknown; --cfg takes job, all or nothing (the run's config; "
                  "there is no hydra: section) and is followed by overrides key=value", file=sys.stderr)
            return 2
    bad = [a for a in argv if a.startswith("-") and a != "--cfg"]
    if bad:
        print(f"dropless-train: unknown option(s) {bad}; arguments are Hydra overrides key=value "
              "(see --help)", file=sys.stderr)
        return 2
    return [a for a in argv if a != "--cfg"], show_cfg


def _start(overrides: list[str], show_cfg: bool) -> tuple[Any, Any] | int:
    """Compose the config and build the trainer: ``(cfg, trainer)``, or the exit status (``--cfg``, an
    error during start-up)."""
    import os

    import torch
    from omegaconf import OmegaConf

    from dropless.config import ConfigError
    from dropless.train.config import compose
    from dropless.train.dist import elastic_restart
    from dropless.train.report import report_error

    rank = int(os.environ.get("RANK", "0"))
    cfg = None
    try:
        cfg = compose(overrides)
        restarts = elastic_restart(cfg)
        from dropless.train.startup import check_train_config
        from dropless.train.trainer import Trainer

        if show_cfg:
            check_train_config(cfg)  # ranges and the model, from the config alone (a run checks them at start)
            print(OmegaConf.to_yaml(cfg, resolve=True), end="")
            return 0
        if rank == 0 and restarts:
            print(f"[dropless] torchrun restart {restarts}: resuming from the newest complete checkpoint", flush=True)
        trainer = Trainer(cfg)  # every check (config, device, mesh, backend, data, run dir) before a step
        if rank == 0:  # after the checks: a bad value's error is the last thing on the terminal
            print("[dropless] resolved config:\n" + OmegaConf.to_yaml(cfg, resolve=True), flush=True)
            for note in trainer.warnings:  # printed above the config as they came; again where they are seen
                print(f"[dropless] warning (repeated from start-up): {note}", flush=True)
        return cfg, trainer
    except ConfigError as e:
        return report_error(f"{e}{_restarts_note()}", rank, 2)  # once: rank 0 prints it
    except torch.OutOfMemoryError as e:
        print(f"dropless-train: error: {_out_of_memory(cfg, 'during start-up', e)}{_restarts_note()}",
              file=sys.stderr, flush=True)
        return 2


def _train(cfg: Any, trainer: Any) -> int:
    """Run the built trainer; the exit status (see the module docstring)."""
    import os

    import torch

    from dropless.routing import NONFINITE_LOGITS
    from dropless.train.checkpoint import latest_checkpoint
    from dropless.train.dist import collective_failure
    from dropless.train.trainer import NonFiniteError

    try:
        summary = trainer.train()
    except KeyboardInterrupt:  # a second Ctrl-C (SIGINT/SIGTERM) during the stop the first one asked for
        summary = None
    except NonFiniteError as e:
        print(f"dropless-train: error: {e}", file=sys.stderr, flush=True)
        return 3
    except torch.OutOfMemoryError as e:
        newest = latest_checkpoint(trainer.run_dir)
        print(f"dropless-train: error: {_out_of_memory(cfg, f'at step {trainer.step + 1}', e, newest)}",
              file=sys.stderr, flush=True)
        return 2
    except RuntimeError as e:
        if NONFINITE_LOGITS in str(e):  # the router's check (on CPU; on CUDA a device-side assert)
            print(f"dropless-train: error: step {trainer.step + 1}: {str(e).strip()}; or set "
                  "train.nonfinite=skip to skip such steps", file=sys.stderr, flush=True)
            return 3
        msg = collective_failure(e, float(cfg.train.dist_timeout_s), trainer.env.rank, trainer.env.world_size)
        if msg is not None:
            print(f"dropless-train: error: {msg}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1)  # the process group is broken: tearing it down (here or at exit) could block again
        raise
    finally:
        trainer.close()
    if summary is None:
        saved = latest_checkpoint(trainer.run_dir)
        print(f"dropless-train: aborted by a second interrupt after step {trainer.step}, without the checkpoint the "
              "first one asked for; " + (f"resume=true run_dir={trainer.run_dir} continues from step {saved[0]}"
                                          if saved else "no complete checkpoint was written"),
              file=sys.stderr, flush=True)
        return 130
    if summary["diverged"]:  # train.nonfinite=skip: the checkpoint is written, but the run is no success
        print(f"dropless-train: error: {summary['diverged']}", file=sys.stderr, flush=True)
        return 3
    return 130 if summary["interrupted"] else 0


if __name__ == "__main__":
    sys.exit(main())
