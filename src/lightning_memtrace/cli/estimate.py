"""``memtrace estimate``: will a fine-tuning run fit, by category, before any GPU or weight is involved.

Usage::

    memtrace estimate --config qwen2.5-1.5b.json --batch-size 16 --seq-len 256 --device-memory 80GiB
    memtrace estimate --config path/to/model_folder --seq-len 2048 --precision bf16-mixed \\
        --gradient-checkpointing --device-memory 80GiB --find-max-batch
    memtrace estimate --config qwen2.5-1.5b.json --batch-size 16 --seq-len 256 --device-memory 24GiB --what-if
    memtrace estimate --config bert/config.json --task sequence-classification --batch-size 32 --seq-len 128
    memtrace estimate --config vit/config.json --task image-classification --batch-size 64
    memtrace estimate --config qwen2.5-7b/config.json --batch-size 4 --seq-len 1024 --precision bf16-mixed \
        --quantize nf4 --lora --gradient-checkpointing --device-memory 24GiB

The model is built from its Hugging Face config on the meta device and trained for a few steps on fake tensors
(:func:`lightning_memtrace.estimator.estimate_from_config`). Exit status: 0 when it fits (or no budget was given),
1 when it does not fit (or no batch size fits; with ``--what-if``: when today's setup does not fit), 2 on an error (one line ``memtrace: error: ...`` on stderr).

Standalone: ``python -m lightning_memtrace.cli.estimate --config ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
from collections.abc import Iterator, Sequence
from typing import Any

from lightning_memtrace.cli.args import bytes_arg, positive_int, probability
from lightning_memtrace.cli.errors import PROG, Parser, describe, error_line, run_guarded
from lightning_memtrace.types import Quantization, Task
from lightning_memtrace.units import format_bytes

NOT_FIT_EXIT = 1
#: ``--optimizer`` choices and what each builds (the values of ``estimator.OptimizerName``; kept here so that the
#: parser does not import torch).
OPTIMIZERS = {
    "adamw": "AdamW (2 state tensors per parameter)",
    "adam": "Adam (2 state tensors per parameter)",
    "sgd": "SGD with momentum 0.9 (1 state tensor per parameter)",
    "sgd-plain": "SGD without momentum (no state)",
}
#: ``--remedies`` choices (the values of ``estimator.remedies.Remedy``, kept here so that the parser does not import
#: torch); ``zero3`` is read as ``fsdp``.
REMEDIES = (
    "gradient_as_bucket_view",
    "optimizer_foreach_off",
    "bf16-mixed",
    "16-mixed",
    "adamw_8bit",
    "half_micro_batch",
    "gradient_checkpointing",
    "adafactor",
    "bf16-true",
    "optimizer_offload",
    "fsdp",
    "lora",
    "qlora",
)
PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "bf16-true", "16-true")
#: ``--attn-implementation`` choices (transformers' names); without the option, transformers' default for the model.
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")
#: Options passed through to :func:`~lightning_memtrace.estimator.estimate_from_config` as they are.
_ESTIMATE_OPTIONS = (
    "optimizer",
    "precision",
    "gradient_checkpointing",
    "accumulate_grad_batches",
    "device",
    "fsdp",
    "ddp_buckets",
    "task",
    "target_len",
    "image_size",
    "quantize",
    "lora",
)
#: Errors whose message alone is the one line (anything else also names its type).
PLAIN_ERRORS = (ValueError, OSError, KeyError, TypeError, ModuleNotFoundError, json.JSONDecodeError)


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        required=True,
        help="a Hugging Face config.json, a folder holding one, or a hub id (where the network allows)",
    )
    parser.add_argument(
        "--batch-size", type=positive_int, default=None, help="micro-batch size (required unless --find-max-batch)"
    )
    parser.add_argument(
        "--seq-len", type=positive_int, default=None, help="tokens per sequence (required but for image and speech)"
    )
    parser.add_argument(
        "--task",
        choices=[task.value for task in Task],
        default=Task.CAUSAL_LM.value,
        help="what the model is trained for: the transformers auto class that builds it (AutoModelFor...) and the "
        "labels of its batch (default causal-lm)",
    )
    parser.add_argument(
        "--target-len",
        type=positive_int,
        default=None,
        help="seq2seq-lm, speech-seq2seq: tokens of the labels (default --seq-len; speech: the config's "
        "max_target_positions)",
    )
    parser.add_argument(
        "--image-size",
        type=positive_int,
        default=None,
        help="image-classification: an image's side in pixels (default: the config's image_size, else 224)",
    )
    parser.add_argument(
        "--quantize",
        choices=[quantization.value for quantization in Quantization],
        default=None,
        help="the base loaded quantized by bitsandbytes, as from_pretrained(..., quantization_config="
        "BitsAndBytesConfig(...)) loads it: nf4 (QLoRA's 4-bit base, double quantization, computing in the "
        "precision's half type) or int8; with --lora, a QLoRA run (needs bitsandbytes)",
    )
    parser.add_argument(
        "--lora",
        action="store_true",
        help="train LoRA adapters (peft; a task head in full), the base frozen (needs peft)",
    )
    parser.add_argument("--lora-rank", type=positive_int, default=None, help="--lora: the adapters' r (default 16)")
    parser.add_argument(
        "--lora-dropout",
        type=probability,
        default=None,
        help="--lora: lora_dropout (default 0; above 0 each adapted layer keeps a dropped-out copy of its input)",
    )
    parser.add_argument(
        "--lora-targets",
        default=None,
        help="--lora: the layers adapted: attention (the attention projections, default), all-linear (every linear "
        "layer but the output and task heads, as peft's target_modules='all-linear'), or names (q_proj,v_proj)",
    )
    parser.add_argument(
        "--optimizer",
        choices=tuple(OPTIMIZERS),
        default="adamw",
        help="; ".join(f"{name}: {what}" for name, what in OPTIMIZERS.items()) + " (default adamw)",
    )
    parser.add_argument("--precision", choices=PRECISIONS, default="32-true", help="Lightning's precision setting")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="non-reentrant activation checkpointing")
    parser.add_argument("--accumulate-grad-batches", type=positive_int, default=1)
    parser.add_argument(
        "--attn-implementation",
        choices=ATTN_IMPLEMENTATIONS,
        default=None,
        help="the attention the run uses (default: what transformers picks for the model, SDPA for most); "
        "the estimate states the SDPA kernel it assumed",
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="the device to estimate for")
    parser.add_argument(
        "--fsdp",
        type=positive_int,
        default=1,
        metavar="N",
        help="shard with FSDP2 over N ranks (each repeated block, then the root), measured on rank 0 with torch's "
        "fake process group (default 1: unsharded)",
    )
    parser.add_argument(
        "--ddp",
        dest="ddp_buckets",
        action="store_true",
        help="data-parallel with DDP's defaults (gradient_as_bucket_view=False): its gradient buckets, a second copy "
        "of the gradients, on every rank (--what-if then tries gradient_as_bucket_view)",
    )
    parser.add_argument(
        "--device-memory",
        type=bytes_arg,
        default=None,
        help="memory of the device, e.g. 80GiB (1024-based) or 80GB (1000-based)",
    )
    parser.add_argument(
        "--find-max-batch", action="store_true", help="search the largest micro-batch that fits in --device-memory"
    )
    parser.add_argument(
        "--max-batch-size",
        type=positive_int,
        default=4096,
        help="upper end of the --find-max-batch search (default 4096)",
    )
    parser.add_argument(
        "--what-if",
        action="store_true",
        help="estimate again with each remedy applied (precision, checkpointing, optimizers, LoRA, sharding...) and "
        "search the cheapest combination that fits --device-memory",
    )
    parser.add_argument(
        "--devices", type=positive_int, default=1, help="N for the fsdp/zero3 remedy of --what-if (default 1: none)"
    )
    parser.add_argument(
        "--remedies",
        type=_remedy_list,
        default=None,
        help="comma-separated remedies for --what-if (default all): " + ", ".join(REMEDIES),
    )
    parser.add_argument(
        "--jobs",
        type=positive_int,
        default=None,
        help="worker processes for --what-if's estimates, side by side (default: the CPUs here, at most 4; the answer "
        "is the same for any value)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")


def _remedy_list(text: str) -> list[str]:
    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    names = ["fsdp" if name in ("zero3", "zero-3") else name for name in names]
    unknown = [name for name in names if name not in REMEDIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown remedy {', '.join(unknown) or repr(text)}; use {', '.join(REMEDIES)}"
        )
    return names


def add_estimate_subcommand(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``estimate`` to a ``memtrace`` subparsers object; its handler is :func:`run_estimate` (``func``)."""
    parser = subparsers.add_parser(
        "estimate",
        help="estimate the memory of a training step from a model config (no GPU, no weights)",
        description="Estimate per phase and per category the memory of training a Hugging Face model (a causal LM "
        "unless --task says otherwise), by running real training steps on fake tensors. Exit status 0: fits, 1: does "
        "not fit, 2: error.",
    )
    _configure(parser)
    parser.set_defaults(func=run_estimate)
    return parser


#: The name :mod:`lightning_memtrace.cli.parser` looks for in the modules it lists.
add_subcommand = add_estimate_subcommand


def run_estimate(args: argparse.Namespace) -> int:
    """Run ``memtrace estimate``; returns the exit status (never raises, never prints a traceback)."""
    return run_guarded(_run, args, error_line, lambda: error_line("interrupted"), PLAIN_ERRORS)


def _check(args: argparse.Namespace) -> None:
    task = Task(args.task)
    if args.seq_len is None and task.takes_tokens:
        raise ValueError(f"--seq-len is required for --task {task}")
    if args.seq_len is not None and not task.takes_tokens:
        raise ValueError(f"--seq-len does not go with --task {task}: its inputs' shape comes from the config")
    if args.target_len is not None and not task.takes_target_len:
        raise ValueError(f"--target-len goes with --task {' or '.join(t for t in Task if t.takes_target_len)}")
    if args.image_size is not None and not task.takes_image_size:
        raise ValueError(f"--image-size goes with --task {' or '.join(t for t in Task if t.takes_image_size)}")
    if args.what_if and args.batch_size is None:
        raise ValueError("--what-if needs --batch-size")
    if args.batch_size is None and not args.find_max_batch:
        raise ValueError("--batch-size is required (or use --find-max-batch with --device-memory)")
    if args.find_max_batch and args.device_memory is None:
        raise ValueError("--find-max-batch needs --device-memory")
    if (args.devices > 1 or args.remedies or args.jobs) and not args.what_if:
        raise ValueError("--devices, --remedies and --jobs go with --what-if")
    if args.ddp_buckets and args.fsdp > 1:
        raise ValueError("--ddp and --fsdp describe two different runs: give one of them")
    if not args.lora and (args.lora_rank, args.lora_dropout, args.lora_targets) != (None, None, None):
        raise ValueError("--lora-rank, --lora-dropout and --lora-targets go with --lora")


def _compute(args: argparse.Namespace) -> tuple[Any, Any]:
    """The estimate to show (None when no batch size fits) and the search (None without ``--find-max-batch``)."""
    import warnings

    from lightning_memtrace.estimator import estimate_from_config, find_max_batch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _meta_model(args)

        def run(batch_size: int) -> Any:
            options = _estimate_options(args)
            return estimate_from_config(args.config, batch_size, args.seq_len, model=model, **options)

        search = None
        estimates: dict[int, Any] = {}
        if args.find_max_batch:

            def peak_for(size: int) -> int:
                estimates[size] = run(size)
                return estimates[size].peak_bytes

            search = find_max_batch(peak_for, args.device_memory, low=1, high=args.max_batch_size)
        shown_size = args.batch_size if args.batch_size is not None else (search.batch_size if search else None)
        shown = (estimates.get(shown_size) or run(shown_size)) if shown_size else None
    return shown, search


def _json_object(args: argparse.Namespace, shown: Any, search: Any, fits: bool | None) -> dict[str, Any]:
    payload: dict[str, Any] = {"estimate": shown.as_dict() if shown is not None else None}
    if args.device_memory is not None:
        payload["device_memory"] = args.device_memory
        payload["fits"] = fits
        if shown is not None and shown.allocator:
            payload["allocator_fits"] = shown.allocator_fits(args.device_memory)
    if search is not None:
        payload["max_batch_size"] = search.batch_size
        payload["searched_peaks"] = {str(k): v for k, v in search.peaks.items()}
    return payload


def _print_json(args: argparse.Namespace, shown: Any, search: Any, fits: bool | None) -> None:
    print(json.dumps(_json_object(args, shown, search, fits), indent=2))


def _results(args: argparse.Namespace) -> tuple[Any, Any, bool | None]:
    _check(args)
    shown, search = _compute(args)
    fits = shown.fits(args.device_memory) if shown is not None and args.device_memory is not None else None
    return shown, search, fits


def estimate_payload(args: argparse.Namespace) -> dict[str, Any]:
    """``memtrace estimate --json``'s object for parsed ``args`` (whether or not it fits): what the command prints
    and the MCP ``estimate`` tool returns."""
    return _json_object(args, *_results(args))


def _distinct(*values: int) -> list[str]:
    """The sizes, with as many digits as it takes for different byte counts to read differently (at most 3
    decimals; beyond that, the exact bytes too)."""
    for precision in (1, 2, 3):
        texts = [format_bytes(v, precision) for v in values]
        if all(texts[i] != texts[j] for i in range(len(values)) for j in range(i) if values[i] != values[j]):
            return texts
    return [f"{format_bytes(v, 3)} ({int(v):,} B)" for v in values]


def _fit_line(budget_bytes: int, shown: Any, fits: bool) -> str:
    budget, peak = _distinct(budget_bytes, shown.peak_bytes)
    if fits:
        spare = format_bytes(budget_bytes - shown.peak_bytes)
        return f"fits in {budget}: peak {peak}, {spare} to spare"
    over = format_bytes(shown.peak_bytes - budget_bytes)
    return f"does not fit in {budget}: peak {peak}, {over} over"


def _allocator_line(budget_bytes: int | None, shown: Any) -> str:
    """What the caching allocator needs for the run, fragmentation included, whether the budget holds it, and what it
    would need with expandable segments."""
    needs = shown.allocator_needs()
    expandable = shown.allocator_needs_expandable()
    figures = [needs, *([] if expandable is None else [expandable]), *([] if budget_bytes is None else [budget_bytes])]
    texts = dict(zip(figures, _distinct(*figures)))

    def verdict(needed: int) -> str:
        if budget_bytes is None:
            return ""
        return f" (in {texts[budget_bytes]} it {'serves it' if needed <= budget_bytes else 'runs out'})"

    line = (
        f"the caching allocator needs {texts[needs]} ({needs:,} B) to serve every request, fragmentation "
        f"included, the steady step served on past the estimated steps{verdict(needs)}; it reserves up to "
        f"{format_bytes(shown.long_run_reserved_bytes)} where nothing makes it free its cache"
    )
    if expandable is not None:
        line += f"; with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True it needs {texts[expandable]}"
        line += verdict(expandable)
    return line


def _search_line(budget_bytes: int, search: Any) -> str:
    if search.batch_size == 0:
        budget, first = _distinct(budget_bytes, search.peaks.get(1, 0))
        return f"no micro-batch fits in {budget} (batch 1 peaks at {first})"
    more = " (the search's upper end: larger may fit)" if search.capped else ""
    nxt = search.peaks.get(search.batch_size + 1)
    if nxt is None:
        budget, peak = _distinct(budget_bytes, search.peaks[search.batch_size])
        after = ""
    else:
        budget, peak, next_peak = _distinct(budget_bytes, search.peaks[search.batch_size], nxt)
        after = f"; {search.batch_size + 1} peaks at {next_peak}"
    return f"largest micro-batch that fits in {budget}: {search.batch_size}{more} (peak {peak}{after})"


def _positions_note(args: argparse.Namespace) -> str | None:
    """A note where ``--seq-len`` is over the positions the model was made for (its memory is still estimated)."""
    from lightning_memtrace.models import load_config_dict

    try:
        fields = load_config_dict(args.config)
    except (OSError, ValueError):  # a hub id: the estimate read it already, the note is not worth a second fetch
        return None
    limit = next((fields[key] for key in ("max_position_embeddings", "n_positions") if key in fields), None)
    if not isinstance(limit, int) or args.seq_len <= limit:
        return None
    return f"note: --seq-len {args.seq_len:,} is over the model's {limit:,} positions: it may not run at that length"


def _print_text(args: argparse.Namespace, shown: Any, search: Any, fits: bool | None) -> None:
    note = _positions_note(args)
    if note is not None:
        print(note)
    if shown is not None:
        print(shown.table())
    if fits is not None and shown is not None:
        print(_fit_line(args.device_memory, shown, fits))
    if shown is not None and shown.allocator:
        print(_allocator_line(args.device_memory, shown))
    if search is not None:
        print(_search_line(args.device_memory, search))
    if shown is not None and shown.allocator:
        print("allocated and reserved as CUDA's caching allocator would count them; leave room for the CUDA context")
    else:
        print("estimate of allocated bytes")


def _estimate_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options :func:`~lightning_memtrace.estimator.estimate_from_config` takes, from ``args``; ``lora`` as a
    :class:`~lightning_memtrace.estimator.remedies.LoraShape` (or False)."""
    options = {name: getattr(args, name) for name in _ESTIMATE_OPTIONS}
    if args.lora:
        from lightning_memtrace.estimator.remedies import LORA_RANK, LoraShape

        targets = args.lora_targets or "attention"
        if targets not in ("attention", "all-linear"):
            targets = tuple(name.strip() for name in targets.split(",") if name.strip())
        options["lora"] = LoraShape(args.lora_rank or LORA_RANK, args.lora_dropout or 0.0, targets)
    return options


def _meta_model(args: argparse.Namespace) -> Any:
    from lightning_memtrace.estimator import AttentionUnavailableError, build_meta_model

    try:
        return build_meta_model(args.config, args.attn_implementation, args.task)
    except AttentionUnavailableError:
        raise
    except (OSError, ValueError, RecursionError) as error:
        raise ValueError(f"cannot read the model config {args.config!r}: {str(error).splitlines()[0]}") from None
    except Exception as error:  # transformers' own check of a field, or a size no layer can be built with
        # describe(): "Type: message"; the error line puts a message of several lines (pydantic's) on one
        raise ValueError(f"the model config {args.config!r} does not build a model ({describe(error, ())})") from None


def _run_what_if(args: argparse.Namespace) -> int:
    """``--what-if``: today's estimate, each remedy's, the cheapest combination; exit 1 when today's does not fit."""
    import warnings

    from lightning_memtrace.estimator.forked import default_jobs
    from lightning_memtrace.estimator.what_if import what_if_from_config

    if args.fsdp > 1:
        raise ValueError("--what-if compares remedies for one device: give the fsdp remedy its devices with --devices N")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = what_if_from_config(
            args.config,
            args.batch_size,
            args.seq_len,
            model=_meta_model(args),
            device_memory=args.device_memory,
            devices=args.devices,
            remedies=args.remedies,
            max_batch=args.find_max_batch,
            max_batch_size=args.max_batch_size,
            jobs=args.jobs or default_jobs(),
            **{name: value for name, value in _estimate_options(args).items() if name != "fsdp"},
        )
    shown = result.estimate
    fits = result.today_fits
    if args.json:
        print(json.dumps({**result.as_dict(), "fits": fits}, indent=2))
    else:
        print(shown.table())
        if shown.allocator:
            print(_allocator_line(None, shown))
        print(result.table())
    return NOT_FIT_EXIT if fits is False else 0


@contextlib.contextmanager
def _transformers_quiet() -> Iterator[None]:
    """transformers' own log lines about the config it builds (``loss_type=None`` ... unrecognized) are not the
    command's answer: only errors of its get through while the command runs."""
    with contextlib.suppress(ImportError):
        # transformers sets its logger's level when it first configures it: that happens now, not over ours later
        from transformers.utils import logging as transformers_logging

        transformers_logging.get_logger()
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _run(args: argparse.Namespace) -> int:
    with _transformers_quiet():
        return _answer(args)


def _answer(args: argparse.Namespace) -> int:
    if args.what_if:
        _check(args)
        return _run_what_if(args)
    shown, search, fits = _results(args)
    (_print_json if args.json else _print_text)(args, shown, search, fits)
    if (search is not None and search.batch_size == 0) or fits is False:
        return NOT_FIT_EXIT
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The standalone parser (``python -m lightning_memtrace.cli.estimate``)."""
    parser = Parser(prog=f"{PROG} estimate", description=(__doc__ or "").splitlines()[0])
    _configure(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_estimate(args)


if __name__ == "__main__":
    raise SystemExit(main())
