"""A TCP proxy whose connections a test cuts at once, as a network blip between an agent and the plane
would: both ends see their connection reset, and new connections go through again."""

from __future__ import annotations

import asyncio
import contextlib
import threading


class CutProxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.writers: set[asyncio.StreamWriter] = set()
        self.cut_count = 0
        self.loop = asyncio.new_event_loop()
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.started.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        self.started.set()
        self.loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self.writers |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()
        self.writers.discard(writer)

    def cut(self) -> None:
        """Reset every connection through the proxy now."""

        def close_all() -> None:
            self.cut_count += len(self.writers)
            for writer in list(self.writers):
                with contextlib.suppress(OSError):
                    writer.transport.abort()
            self.writers.clear()

        self.loop.call_soon_threadsafe(close_all)

    def close(self) -> None:
        async def shut() -> None:
            self.server.close()
            for writer in list(self.writers):
                writer.transport.abort()
            pending = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shut(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
