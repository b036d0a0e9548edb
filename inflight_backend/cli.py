"""The `inflight` command: serve, generate, make-model."""
from __future__ import annotations

import argparse
import os
import queue
import sys
from pathlib import Path

from .paths import BUILD_DIR, PROJECT_ROOT
from .server import RESTRICTED_APIS, ServerError, TritonServer

DEFAULT_MODEL_DIR = BUILD_DIR / "models" / "tiny-llama"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inflight", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_serve(commands.add_parser("serve", help="start tritonserver with the inflight backend"))
    _add_generate(commands.add_parser("generate", help="stream a completion over gRPC"))
    _add_make_model(commands.add_parser("make-model", help="write a tiny random Llama checkpoint"))
    _add_build_engine(commands.add_parser("build-engine", help="build a TensorRT engine with the PagedAttention "
                                                               "plugin (TensorRT-RTX builds without a GPU)"))
    bench = commands.add_parser("bench", help="serving benchmark (benchmarks/serve_bench.py; --help there)",
                                add_help=False)
    bench.set_defaults(run=None)
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    ours, extra = argv, []
    if argv[:1] == ["serve"] and "--" in argv:  # serve: what follows `--` goes to tritonserver as it is
        ours, extra = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = parser.parse_args(ours)
    args.raw_argv, args.triton_args = argv, extra
    try:
        return args.run(args)
    except ServerError as exc:
        print(f"inflight: {exc}", file=sys.stderr)
        return 1


def _add_serve(p: argparse.ArgumentParser) -> None:
    p.usage = "inflight serve [options] [-- TRITONSERVER_OPTION ...]"
    p.add_argument("--model-repository", default=str(PROJECT_ROOT / "model_repository"))
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default loopback; 0.0.0.0 in a container)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--log-verbose", type=int, default=0)
    p.add_argument("--restricted-api", default=",".join(RESTRICTED_APIS),
                   help="Triton API groups that need the admin key header ('none': none; default: %(default)s)")
    p.add_argument("--admin-key", default=os.environ.get("INFLIGHT_ADMIN_KEY"),
                   help="value of the 'inflight-admin-key' header the restricted APIs require (default: "
                        "$INFLIGHT_ADMIN_KEY, else the key in build/triton/admin-key, mode 0600, made at random "
                        "the first time)")
    p.add_argument("--max-restarts", type=int, default=5,
                   help="restarts after a model stub dies, within 10 minutes, before exiting with 1")
    p.add_argument("--stop-timeout", type=float, default=15.0,
                   help="on SIGTERM: seconds tritonserver has to exit once every stream has ended (default 15)")
    p.set_defaults(run=_serve)


def _serve(args) -> int:
    from .repository import check_repository
    from .supervisor import log, run_supervised

    problems = check_repository(args.model_repository)
    if problems:
        raise ServerError("cannot serve " + args.model_repository + ":\n  " + "\n  ".join(problems))
    apis = tuple(a for a in args.restricted_api.split(",") if a and a != "none")
    key = (args.admin_key or _admin_key_file(BUILD_DIR / "triton" / "admin-key")) if apis else None

    def make_server() -> TritonServer:
        return TritonServer(args.model_repository, args.http_port, args.grpc_port, args.metrics_port,
                            verbose=args.log_verbose, host=args.host, extra_args=tuple(args.triton_args),
                            restricted_apis=apis, admin_key=key)

    def on_ready(server: TritonServer) -> None:
        where = server.host if ":" not in server.host else f"[{server.host}]"
        print(f"inflight: ready. HTTP {where}:{server.http_port}, gRPC {where}:{server.grpc_port}, "
              f"metrics {where}:{server.metrics_port}\n"
              f"  try: inflight generate \"Hello\" --url localhost:{server.grpc_port}", flush=True)

    log(f"starting tritonserver with {Path(args.model_repository).resolve()}")
    if apis and not args.admin_key:
        log(f"restricted APIs ({', '.join(apis)}) need the header 'inflight-admin-key' (gRPC: "
            f"'triton-grpc-protocol-inflight-admin-key') set to the key in {BUILD_DIR / 'triton' / 'admin-key'}")
    return run_supervised(make_server, on_ready, args.max_restarts, args.stop_timeout)


def _admin_key_file(path: Path) -> str:
    """The key kept in `path` (readable by this user only), created with a random key the first time."""
    import secrets

    if path.exists():
        return path.read_text().strip()
    key = secrets.token_hex(16)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


def _add_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--url", default="localhost:8001", help="gRPC address of the server")
    p.add_argument("--model", default="llm")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(run=_generate)


def _generate(args) -> int:
    import numpy as np
    import tritonclient.grpc as grpcclient

    def tensor(name, value, dtype, triton_type):
        t = grpcclient.InferInput(name, [1], triton_type)
        t.set_data_from_numpy(np.array([value], dtype=dtype))
        return t

    inputs = [tensor("text_input", args.prompt.encode(), np.object_, "BYTES"),
              tensor("max_tokens", args.max_tokens, np.int32, "INT32"),
              tensor("stream", True, bool, "BOOL"),
              tensor("temperature", args.temperature, np.float32, "FP32")]
    if args.seed is not None:
        inputs.append(tensor("seed", args.seed, np.uint64, "UINT64"))
    results: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(args.url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer(args.model, inputs, enable_empty_final_response=True)
    try:
        return _print_stream(results)
    finally:
        client.stop_stream()


def _print_stream(results: queue.SimpleQueue) -> int:
    while True:
        result, error = results.get()
        if error is not None:
            print(f"\ninflight: {error}", file=sys.stderr)
            return 1
        text = result.as_numpy("text_output")
        if text is not None and text.size:
            sys.stdout.write(text[0].decode("utf-8", errors="replace"))
            sys.stdout.flush()
        response = result.get_response()
        if response.parameters["triton_final_response"].bool_param:
            reason = result.as_numpy("finish_reason")
            counts = result.as_numpy("num_input_tokens"), result.as_numpy("num_output_tokens")
            if reason is not None:
                print(f"\n[finish_reason={reason[0].decode()} prompt_tokens={int(counts[0][0])} "
                      f"completion_tokens={int(counts[1][0])}]", file=sys.stderr)
            return 0


def _add_build_engine(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--out", required=True, help="output directory, e.g. build/engines/tiny")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                   help="weights, activations and KV pool of the engine (RMSNorm in fp32, logits fp32)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-tokens", type=int, default=1024)
    p.add_argument("--max-seqs", type=int, default=64)
    p.add_argument("--max-num-blocks", type=int, default=4096)
    p.set_defaults(run=_build_engine)


def _build_engine(args) -> int:
    import json
    import os

    from .tensorrt.trt_module import parser_library_dir, parser_ready

    if not parser_ready():  # the ONNX parser's dlopen needs LD_LIBRARY_PATH from process start: re-exec
        env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(
            filter(None, [str(parser_library_dir()), os.environ.get("LD_LIBRARY_PATH")])))
        os.execve(sys.executable, [sys.executable, "-m", "inflight_backend.cli", *args.raw_argv], env)
    from .tensorrt.builder import EngineSpec, build_engine

    spec = EngineSpec(str(Path(args.checkpoint).resolve()), args.block_size, args.max_num_tokens, args.max_seqs,
                      args.max_num_blocks, args.dtype)
    print(json.dumps(build_engine(spec, args.out), indent=1))
    return 0


def _bench(argv: list[str]) -> int:
    sys.path.insert(0, str(PROJECT_ROOT))
    from benchmarks.serve_bench import main as bench_main

    bench_main(argv)
    return 0


def _add_make_model(p: argparse.ArgumentParser) -> None:
    from .make_model import TinySpec

    defaults = TinySpec()
    p.add_argument("out_dir", nargs="?", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--hidden-size", type=int, default=defaults.hidden_size)
    p.add_argument("--intermediate-size", type=int, default=defaults.intermediate_size)
    p.add_argument("--layers", type=int, default=defaults.num_hidden_layers)
    p.add_argument("--heads", type=int, default=defaults.num_attention_heads)
    p.add_argument("--kv-heads", type=int, default=defaults.num_key_value_heads)
    p.add_argument("--max-position-embeddings", type=int, default=defaults.max_position_embeddings)
    p.add_argument("--rope-theta", type=float, default=defaults.rope_theta)
    p.add_argument("--tie-word-embeddings", action="store_true")
    p.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--if-missing", action="store_true",
                   help="do nothing when OUT_DIR holds config.json and tokenizer_config.json (the weights are seeded: "
                        "a checkpoint made before tokenizer_config.json existed is remade identically)")
    p.set_defaults(run=_make_model)


def _make_model(args) -> int:
    from .make_model import TinySpec, make_model

    if args.if_missing and all((Path(args.out_dir) / f).exists() for f in ("config.json", "tokenizer_config.json")):
        return 0
    spec = TinySpec(args.hidden_size, args.intermediate_size, args.layers, args.heads, args.kv_heads,
                    args.max_position_embeddings, args.rope_theta, args.tie_word_embeddings, args.seed, args.shards,
                    args.vocab_size)
    print(f"inflight: wrote {make_model(args.out_dir, spec)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
