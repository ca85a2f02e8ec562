from __future__ import annotations

from pathlib import Path

import click

from . import force_option, load, output_option, set_option, spec_argument


@click.command("quantize")
@spec_argument
@set_option
@output_option
@click.option(
    "--checkpoint",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Checkpoint to quantize (default: the fetch stage's output).",
)
@force_option
def command(spec_path, overrides, output, checkpoint, force):
    """Quantize with ModelOpt, export HF + TensorRT-LLM checkpoints, and gate on perplexity."""
    from ..quantize import quantize

    result = quantize(load(spec_path, overrides), checkpoint=checkpoint, output=output, force=force)
    click.echo(result.summary)
    q = result.manifest.get("quality", {})
    if q:
        click.echo(f"perplexity {q['baseline_ppl']:.3f} -> {q['quantized_ppl']:.3f} ({q['increase'] * 100:+.2f} %)")
