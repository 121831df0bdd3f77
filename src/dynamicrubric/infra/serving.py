"""The reward's model servers: vLLM's OpenAI-compatible server for G and V, started by a training task.

On a GPU node a training task's pod holds `world_size + reward_gpus` GPUs. The trainer runs on the first
`world_size`; on the others the task starts one `vllm serve` per reward model it serves itself
(`config.served_roles`: the policy's reward needs G_t and V, the generator's only V), each on its share
of the reward GPUs as data-parallel replicas. The reward functions are their HTTP clients
(`engines.ServerEngine`), so no training rank holds a private engine copy. This is what the RL engines in
the field do with a generative judge (verl's reward loop, OpenRLHF's remote reward server).

`reward_servers` starts them, waits until each answers `/health`, yields their URLs and always stops
them, also when the training fails. A server's output goes to `<log_dir>/<role>.log`; a server that
exits or does not become healthy in `serving.start_timeout_s` fails the task with its last log lines.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from dynamicrubric.infra.config import Config, ConfigError, served_roles

log = logging.getLogger(__name__)


class ServerError(RuntimeError):
    """A model server that did not start or stopped; the message holds the end of its log."""


def free_port() -> int:
    """A port free now; another process may take it before the caller binds it (see VLLMServer)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# `vllm serve` binds its port itself, long after free_port() let it go, and a socket cannot be handed to
# it: a server that exits because another process took the port starts again on a new one, this often.
BIND_ATTEMPTS = 3
ADDRESS_IN_USE = "Address already in use"  # what Linux's EADDRINUSE says in the server's traceback


class VLLMServer:
    """One `vllm serve` process for one model, on the given GPUs (none: vLLM's CPU build)."""

    def __init__(
        self,
        cfg: Config,
        role: str,
        model_dir: str | Path,
        *,
        gpus: list[str],
        log_dir: Path,
        port: int | None = None,
    ) -> None:
        self.role, self.port = role, port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_dir) / f"{role}.log"
        self.attempts_left = BIND_ATTEMPTS - 1 if port is None else 0  # a port the caller chose stays
        s = cfg.serving
        cmd = [*s.command, "--model", str(model_dir), "--served-model-name", role]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--seed", str(cfg.seed)]
        self._port_word = len(cmd) - 3
        cmd += ["--dtype", "auto" if cfg.engine.dtype == "auto" else cfg.engine.dtype]
        cmd += ["--enable-prefix-caching"]  # the judge's questions about one response share its prefix
        # vLLM fills every sampling field a request leaves out from the model's generation_config.json
        # (Qwen3-8B's top_k 20, say); the rubrics that reward the policy must sample as every other rubric
        # of the run does, with the config's settings and nothing else.
        cmd += ["--generation-config", "vllm"]
        if s.max_model_len:
            cmd += ["--max-model-len", str(s.max_model_len)]
        env = dict(os.environ)
        if gpus:
            cmd += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
            cmd += ["--data-parallel-size", str(len(gpus))]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        cmd += list(s.server_args)
        self.command, self._env = cmd, env
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting the %s server on %s: %s", role, gpus or "CPU", " ".join(cmd))
        self._start()

    def _start(self) -> None:
        self._log_from = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as out:
            # Its own process group, so stopping it also stops vLLM's engine-core workers.
            self.process = subprocess.Popen(
                self.command, stdout=out, stderr=subprocess.STDOUT, env=self._env, start_new_session=True
            )

    def _lost_its_port(self) -> bool:
        """Whether the server that exited could not bind its port, and may start again on another."""
        with open(self.log_path, "rb") as f:
            f.seek(self._log_from)
            return self.attempts_left > 0 and ADDRESS_IN_USE in f.read().decode(errors="replace")

    def wait_healthy(self, timeout_s: float) -> None:
        """Until GET /health answers 200; a server that exits or takes longer fails with its log."""
        import httpx

        started = time.monotonic()
        next_note = started + 30
        while True:
            if self.process.poll() is not None and self._lost_its_port():
                taken, self.port = self.port, free_port()
                self.attempts_left -= 1
                self.url = f"http://127.0.0.1:{self.port}"
                self.command[self._port_word] = str(self.port)
                log.warning("the %s server could not bind port %d (another process took it); starting it "
                            "again on port %d", self.role, taken, self.port)  # fmt: skip
                self._start()
            if self.process.poll() is not None:
                raise ServerError(
                    f"the {self.role} server exited with code {self.process.returncode} before it was "
                    f"healthy; the end of {self.log_path}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    log.info("the %s server is healthy after %.0f s", self.role, time.monotonic() - started)
                    return
            except httpx.TransportError:
                pass
            now = time.monotonic()
            if now - started > timeout_s:
                raise ServerError(
                    f"the {self.role} server was not healthy after {timeout_s:.0f} s "
                    f"(serving.start_timeout_s); the end of {self.log_path}:\n{self.log_tail()}"
                )
            if now > next_note:  # a large model loads for minutes: say that it is still coming
                log.info("waiting for the %s server (%.0f s)", self.role, now - started)
                next_note = now + 30
            time.sleep(1)

    def stop(self, grace_s: float = 30) -> None:
        """SIGTERM to its process group, SIGKILL after `grace_s`. Idempotent."""
        if self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        log.info("stopped the %s server", self.role)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def reward_gpu_split(stage: str, cfg: Config, visible: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """This node's GPUs split into the trainer's and each served role's (an equal share each). A node gets
    1/num_nodes of world_size and of reward_gpus (config checks that both split evenly)."""
    tcfg = getattr(cfg, stage)
    roles = served_roles(cfg, stage)
    train, reward = tcfg.world_size // tcfg.num_nodes, tcfg.reward_gpus // tcfg.num_nodes
    on = f" on each of {tcfg.num_nodes} nodes" if tcfg.num_nodes > 1 else ""
    if len(visible) < train + reward:
        per_node = f" / num_nodes {tcfg.num_nodes}" if tcfg.num_nodes > 1 else ""
        raise ConfigError(
            f"{stage}: (world_size {tcfg.world_size} + reward_gpus {tcfg.reward_gpus}){per_node} = "
            f"{train + reward} GPUs, but this task sees {len(visible)}"
        )
    if roles and reward < len(roles):
        raise ConfigError(
            f"{stage}: reward_gpus is {reward}{on} but the task serves {len(roles)} model(s) {list(roles)}: "
            "give each at least one GPU, or its URL in models.<role>_url"
        )
    share = reward // len(roles) if roles else 0
    served = visible[train : train + reward]
    return visible[:train], {r: served[i * share : (i + 1) * share] for i, r in enumerate(roles)}


@contextlib.contextmanager
def reward_servers(
    cfg: Config, stage: str, models: dict[str, str], gpus: dict[str, list[str]], log_dir: Path
) -> Iterator[dict[str, str]]:
    """Start a server for each role in `models` (role -> local model folder) on its `gpus` (empty lists:
    on CPU), wait until all are healthy, and yield role -> URL; stop them all on the way out."""
    servers: list[VLLMServer] = []
    try:
        for role, folder in models.items():
            servers.append(VLLMServer(cfg, role, folder, gpus=gpus.get(role, []), log_dir=log_dir))
        for server in servers:  # they load side by side
            server.wait_healthy(cfg.serving.start_timeout_s)
        yield {s.role: s.url for s in servers}
    finally:
        for server in servers:
            server.stop()
