"""``verispec serve --replicas N``: N engines as a Ray Serve application behind one OpenAI-compatible ingress.

The application has N replica deployments (``replica-0`` .. ``replica-{N-1}``, one replica each, so the
router can name the replica it wants) and one ingress deployment that Ray Serve's HTTP proxy serves
on the server's host and port. A replica (:class:`VerispecReplica`) loads an engine and runs the
single-engine app in-process (:mod:`verispec.server.replica_host`); the ingress (:class:`VerispecIngress`)
routes and forwards (:mod:`verispec.server.ingress`). Ray Serve's controller replaces a replica whose
process dies or whose health check fails.

Ray is an optional extra (``pip install 'verispec[replicas]'``): this module is imported only for
``--replicas``; importing it without Ray raises :class:`~verispec.errors.VerispecError` with that line.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from verispec.errors import VerispecError

try:
    import ray
    from ray import serve
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import DeploymentUnavailableError, RayServeException, ReplicaUnavailableError
    from ray.serve.handle import DeploymentHandle
except ImportError as e:  # pragma: no cover (the CI installs the extra; this is the message without it)
    raise VerispecError("--replicas needs Ray Serve, an optional extra: pip install 'verispec[replicas]' "
                        f"(or pip install 'ray[serve]==2.60.0'); {e}") from None

from verispec.log import logger
from verispec.server.config import ServerConfig
from verispec.server.ingress import Ingress, IngressConfig, ReplicaGone, tokenizer_prompt_text
from verispec.server.replica_host import Forwarded, ReplicaHost

APP_NAME = "verispec"
_GONE = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)


@dataclass(frozen=True)
class ReplicasConfig:
    """A replicated server: ``replicas`` engines of ``model`` (and ``draft``) serving ``server``'s API.

    ``engine`` holds the other :class:`~verispec.config.EngineConfig` fields (dtype, max_len, weights,
    ...); ``ingress`` how the ingress routes and watches the replicas. ``ray_address`` joins an
    existing Ray cluster (None: start Ray on this machine). ``replica_cpus`` is the CPUs Ray reserves
    per replica (Ray places replicas by it: on a cluster of machines with C cores each, C puts one
    replica per machine) and ``threads`` the torch threads each replica computes with (default:
    ``replica_cpus`` rounded down, at least 1).
    """

    replicas: int
    model: str
    server: ServerConfig
    draft: str | None = None
    engine: dict[str, Any] = field(default_factory=dict)
    ingress: IngressConfig = field(default_factory=IngressConfig)  # its router's settings too
    ray_address: str | None = None
    replica_cpus: float = 1.0
    threads: int | None = None
    health_check_period_s: float = 2.0
    ready_timeout_s: float = 900.0  # launch to every replica ready; the launcher gives up after this

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise VerispecError(f"--replicas must be at least 1 (got {self.replicas!r})")
        if self.replica_cpus < 0:
            raise VerispecError(f"replica_cpus must be >= 0 (got {self.replica_cpus!r})")
        if self.threads is not None and self.threads < 1:
            raise VerispecError(f"threads must be at least 1 (got {self.threads!r})")
        if self.health_check_period_s <= 0 or self.ready_timeout_s <= 0:
            raise VerispecError("health_check_period_s and ready_timeout_s must be positive")
        devices = {str(self.engine.get(k) or "cpu") for k in ("device", "target_device", "draft_device")}
        if devices != {"cpu"}:
            # Ray hides accelerators from actors that reserve none; replicas reserve CPUs only.
            raise VerispecError(f"--replicas runs replicas on CPUs (got device {', '.join(sorted(devices - {'cpu'}))})")

    @property
    def torch_threads(self) -> int:
        return self.threads or max(1, int(self.replica_cpus))

    @property
    def max_ongoing(self) -> int:
        """Requests Ray lets into one replica at once: more than its own slots and queue, so the replica's
        app (not Ray's queue) answers 429 when it is full."""
        return self.server.max_batch + self.server.max_queue + 8


@serve.deployment
class VerispecReplica:
    """One engine and the single-engine app; the ingress calls :meth:`forward` per request."""

    async def __init__(self, config: ReplicasConfig) -> None:
        import torch

        from verispec import Engine
        from verispec.server.app import create_app

        torch.set_num_threads(config.torch_threads)
        self.block_chars = config.ingress.router.block_chars
        server = config.server
        engine = await asyncio.to_thread(Engine.from_pretrained, config.model, draft=config.draft,
                                         max_batch=server.max_batch, prefix_reuse=server.prefix_reuse,
                                         **config.engine)
        self.host = ReplicaHost(create_app(engine, server))
        await self.host.start()

    async def forward(self, request: Forwarded) -> AsyncIterator[dict[str, Any]]:
        async for message in self.host.forward(request):
            yield message

    def report(self) -> dict[str, Any]:
        return self.host.report(self.block_chars)

    def metrics(self) -> bytes:
        return self.host.metrics_text()

    def check_health(self) -> None:
        """Ray Serve replaces a replica whose health check raises."""
        if not self.host.alive():
            raise RuntimeError(f"the replica cannot serve (warm-up: {self.host.state.readiness.state}"
                               f"{', ' + self.host.state.readiness.error if self.host.state.readiness.error else ''})")

    async def __del__(self) -> None:
        host = getattr(self, "host", None)  # None when stopped while still loading
        if host is not None:
            await host.stop()


class RayFleet:
    """The ingress's :class:`~verispec.server.ingress.Fleet` over Ray Serve deployment handles."""

    def __init__(self, handles: list[DeploymentHandle]) -> None:
        self._handles = handles
        self.size = len(handles)

    async def forward(self, replica: int, request: Forwarded) -> AsyncIterator[dict[str, Any]]:
        response = self._handles[replica].options(stream=True).forward.remote(request)
        finished = False
        try:
            async for message in response:
                yield message
            finished = True
        except _GONE as e:
            raise ReplicaGone(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
        finally:
            if not finished:
                response.cancel()  # the replica's app sees its client disconnect and cancels the request

    async def report(self, replica: int) -> dict[str, Any]:
        return await self._call(replica, "report")

    async def metrics(self, replica: int) -> bytes:
        return await self._call(replica, "metrics")

    async def _call(self, replica: int, method: str) -> Any:
        response = getattr(self._handles[replica], method).remote()
        try:
            return await response
        except _GONE as e:
            raise ReplicaGone(type(e).__name__) from None
        except asyncio.CancelledError:
            response.cancel()
            raise


@serve.deployment
@serve.ingress()
class VerispecIngress:
    """The ingress deployment: Ray Serve's proxy passes it every HTTP request."""

    def __init__(self, config: ReplicasConfig, replicas: list[DeploymentHandle]) -> None:
        from verispec.models.loader import load_tokenizer, open_source

        tokenizer = load_tokenizer(open_source(config.model))  # renders prompts as the replicas' engines read them
        text = tokenizer_prompt_text(tokenizer) if tokenizer is not None else None
        self.ingress = Ingress(RayFleet(replicas), config.server, text, config.ingress)

    def __serve_build_asgi_app__(self) -> Any:
        return self.ingress.asgi

    async def ready_count(self) -> int:
        """Replicas taking requests (the launcher waits for all of them)."""
        self.ingress.start()
        return self.ingress.ready_count()

    async def __del__(self) -> None:
        ingress = getattr(self, "ingress", None)
        if ingress is not None:
            await ingress.stop()


def build_application(config: ReplicasConfig) -> Any:
    """The Ray Serve application: the ingress bound to ``config.replicas`` replica deployments."""
    cpus = {"num_cpus": config.replica_cpus}
    replicas = [VerispecReplica.options(name=f"replica-{i}", num_replicas=1, max_ongoing_requests=config.max_ongoing,
                                        health_check_period_s=config.health_check_period_s,
                                        graceful_shutdown_timeout_s=config.server.shutdown_timeout_s,
                                        max_constructor_retry_count=3, ray_actor_options=cpus).bind(config)
                for i in range(config.replicas)]
    # --limit-concurrency requests run in the ingress; as many more wait in Ray Serve's proxy (its queue also
    # holds requests on their way in, so it cannot be empty); past both, the proxy answers 503.
    limit = config.server.limit_concurrency or 10_000
    return VerispecIngress.options(name="ingress", num_replicas=1, max_ongoing_requests=limit,
                                   max_queued_requests=limit,
                                   ray_actor_options={"num_cpus": 0}).bind(config, replicas)


def app_builder(args: dict[str, Any]) -> Any:
    """``serve run verispec.server.replicas:app_builder model=NAME replicas=N`` and KubeRay's RayService
    ``import_path``: the application from string arguments (model, draft, replicas, replica_cpus,
    max_batch, max_len, dtype, served_model_name)."""
    known = {"model", "draft", "replicas", "replica_cpus", "max_batch", "max_len", "dtype", "served_model_name"}
    if unknown := set(args) - known:
        raise VerispecError(f"unknown application arguments: {', '.join(sorted(unknown))} (known: "
                            f"{', '.join(sorted(known))})")
    if "model" not in args:
        raise VerispecError("the application needs model=NAME")
    engine = {"max_len": int(args.get("max_len", 4096)), "dtype": str(args.get("dtype", "auto"))}
    server = ServerConfig(model_name=str(args.get("served_model_name") or args["model"]), host="0.0.0.0",
                          max_batch=int(args.get("max_batch", 4)))
    return build_application(ReplicasConfig(replicas=int(args.get("replicas", 2)), model=str(args["model"]),
                                            draft=args.get("draft"), server=server, engine=engine,
                                            replica_cpus=float(args.get("replica_cpus", 1))))


def start(config: ReplicasConfig, *, num_cpus: int | None = None, verbose: bool = False) -> tuple[Any, bool]:
    """Start (or join) Ray, start Serve's proxy on the server's host and port, and deploy the application
    without waiting for the replicas to be ready. Returns the ingress handle and whether Ray was started here
    (``num_cpus`` caps a Ray started here; ``verbose`` keeps Ray Serve's access log and info lines)."""
    check_models(config)
    started_ray = False
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": "INFO" if verbose else "WARNING"}
        if config.ray_address is not None:
            ray.init(address=config.ray_address, **kwargs)
        else:
            ray.init(num_cpus=num_cpus, **kwargs)
            started_ray = True
    logging = {"enable_access_log": verbose, "log_level": "INFO" if verbose else "WARNING"}
    http = {"host": config.server.host, "port": config.server.port,
            "keep_alive_timeout_s": config.server.timeout_keep_alive_s}
    try:
        serve.start(http_options=http, proxy_location="HeadOnly", logging_config=logging)
        handle = serve.run(build_application(config), name=APP_NAME, route_prefix="/", blocking=False,
                           logging_config=logging)
    except RayServeException as e:
        if started_ray:
            shutdown(started_ray)
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise VerispecError(f"the replicas did not start: {first} (run with -v for Ray's log)") from None
    return handle, started_ray


def check_models(config: ReplicasConfig) -> None:
    """Fail here, with the single server's message, on a model or draft that cannot load, rather than in
    every replica's constructor (which Ray Serve would retry)."""
    from verispec.config import EngineConfig
    from verispec.models.loader import open_source

    EngineConfig(model=config.model, draft=config.draft, max_batch=config.server.max_batch, **config.engine)
    open_source(config.model)
    if config.draft is not None and config.draft != "auto":
        open_source(config.draft)


def wait_ready(handle: Any, config: ReplicasConfig, stop: threading.Event | None = None) -> bool:
    """Wait until every replica is ready (True), ``stop`` is set or ``config.ready_timeout_s`` passes (False)."""
    deadline = time.monotonic() + config.ready_timeout_s
    while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
        if handle.ready_count.remote().result(timeout_s=30) >= config.replicas:
            return True
        time.sleep(0.2)
    return False


def shutdown(started_ray: bool) -> None:
    """Delete the application; stop Serve and Ray too when this process started them."""
    try:
        if started_ray:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)
    finally:
        if started_ray:
            ray.shutdown()


def serve_replicas(config: ReplicasConfig, verbose: bool = False) -> bool:
    """Serve until Ctrl-C or SIGTERM, then stop everything this process started; True after a Ctrl-C."""
    stop = threading.Event()
    interrupted = False
    deploying = True  # Ray Serve's deploy call waits for every replica's constructor: a signal interrupts it

    def on_signal(sig: int, _: Any) -> None:
        nonlocal interrupted
        interrupted |= sig == signal.SIGINT
        stop.set()
        if deploying:
            raise KeyboardInterrupt

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    t0 = time.perf_counter()
    started_ray = False
    try:
        logger.info("starting %d replicas on %s", config.replicas,
                    f"the Ray cluster at {config.ray_address}" if config.ray_address else "a local Ray")
        try:
            handle, started_ray = start(config, verbose=verbose)
        except KeyboardInterrupt:
            started_ray = config.ray_address is None
            return interrupted
        deploying = False
        url = f"http://{config.server.host}:{config.server.port}"
        if wait_ready(handle, config, stop):
            logger.info("ready on %s: %d replicas in %.1f s", url, config.replicas, time.perf_counter() - t0)
        elif not stop.is_set():
            logger.warning("not every replica was ready after %.0f s; serving with those that are",
                           config.ready_timeout_s)
        stop.wait()
    finally:
        logger.info("stopping the replicas")
        for s, handler in previous.items():
            signal.signal(s, handler)
        if ray.is_initialized():
            shutdown(started_ray)
    return interrupted
