"""swap-state-server: the per-host state server. Never imports torch. In-process use::

    running = await start_server(ServerConfig(shm_size=8 << 30, listen="unix:///tmp/s.sock"))
    ...  # grpc.aio.insecure_channel(running.address)
    await running.stop()
"""

from swap_state.common.server_config import ServerConfig
from swap_state.common.errors import StartupError
from swap_state.server.runtime import RunningServer, start_server

__all__ = ["RunningServer", "ServerConfig", "StartupError", "start_server"]
