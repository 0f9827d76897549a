"""The ``kiln`` command: ``main`` parses the command line and runs one command; ``build_parser`` is its parser.

One module per command group; each adds its parsers (``add_*_parser``) and holds its ``cmd_*`` functions:

    __main__       ``python -m kiln.cli ...``
    _validate      ``kiln validate`` and ``kiln types``
    _train         the ``kiln train`` parsers, ``kiln train sft|grpo|opd --local``, ``kiln models create-tiny``
    _jobs          ``kiln train sft|grpo|opd|status|cancel`` over HTTP (``--wait`` follows a job)
    _requests      the training request the file and flags describe, its refusal, the SFT resume command
                   (what ``_train`` and ``_jobs`` share)
    _client        ``--url``/``--api-key``/``--json``, the SDK client, error output, ``Interrupt`` (Ctrl-C)
    _server        ``kiln serve`` and ``kiln health``
    _checkpoints   ``kiln checkpoints list|inspect|verify``
    _adapters      ``kiln adapters list|load|unload|delete|restore|verify``
    _replay        ``kiln replay verify|show``: an adapter's request lineage
    _teachers      ``kiln teachers add|list|remove``
    _evals         ``kiln eval suites|run|status|cancel|compare``
    _audit         ``kiln audit``: re-execute a published run and compare its bytes
    _rollouts      ``kiln rollout-generate``: sample, score and publish GRPO groups with recorded provenance
    _parser        the parser class: no abbreviations, "did you mean", a group's own help, defaults in --help

Imports run one way, with no cycle even counting the imports inside functions: this package imports every
command module, ``_train`` imports ``_jobs``, both import ``_requests``, and the client commands import
``_client``; no command module imports this package. What two modules share has a public name in the module
that owns it (no module imports another's ``_`` names); ``tests/test_cli_package.py`` checks both rules.

No torch on the validate/--help path: at import time the command modules import only the standard library,
``kiln.errors`` and each other; torch, the trainers, the server and the SDK (httpx, pydantic) are imported
inside the command functions that use them, so ``kiln --help`` and ``kiln validate`` stay light (a test
checks it).
"""

from __future__ import annotations

import argparse
import os
import sys

from kiln import __version__
from kiln.cli._adapters import add_adapters_parser
from kiln.cli._audit import add_audit_parser
from kiln.cli._checkpoints import add_checkpoints_parser
from kiln.cli._evals import add_eval_parser
from kiln.cli._parser import KilnParser, leaf_parser
from kiln.cli._replay import add_replay_parser
from kiln.cli._rollouts import add_rollout_parser
from kiln.cli._server import add_health_parser, add_serve_parser
from kiln.cli._teachers import add_teachers_parser
from kiln.cli._train import add_models_parser, add_train_parser
from kiln.cli._validate import add_validate_parsers
from kiln.host.progress import show_stages

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = KilnParser(
        prog="kiln",
        description="Train LoRA adapters for local language models; every result comes with a receipt, "
        "a content-bound manifest and exact-resume checkpoints.",
    )
    parser.add_argument("--version", action="version", version=f"kiln {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_validate_parsers(sub)
    add_train_parser(sub)
    add_checkpoints_parser(sub)
    add_adapters_parser(sub)
    add_replay_parser(sub)
    add_models_parser(sub)
    add_serve_parser(sub)
    add_health_parser(sub)
    add_teachers_parser(sub)
    add_eval_parser(sub)
    add_audit_parser(sub)
    add_rollout_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):  # a command group alone (`kiln train`): its own help
        leaf_parser(parser).print_help()
        return 2
    show_stages(True)  # every long step a command waits for is announced on stderr ("loading the weights…")
    try:
        code = int(args.func(args))
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`kiln types | head`): stop quietly with the status SIGPIPE would give, and point
        # stdout at /dev/null so the interpreter's final flush has nowhere to fail.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + 13
    finally:
        show_stages(False)
    return code
