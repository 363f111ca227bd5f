"""An HTTP proxy on loopback in front of an edge that can lie or die, from a thread of its own (so a synchronous
test, or an engine in another process, can go through it): ``mode`` ok | flip (one byte of each object) |
stall | down | slow (objects at ``slow_bps``). Shared by the vLLM and host-tier tests."""

from __future__ import annotations

import threading

from ports import free_port


class Proxy:
    """An HTTP proxy to an edge that can lie: ``mode`` ok | flip (one byte of each object) | stall | down |
    slow (objects at ``slow_bps``)."""

    def __init__(self, target: str = "") -> None:
        import asyncio

        self.target = target  # may be set later, before the first request
        self.mode = "ok"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.objects_served = 0
        self.object_requests = 0  # every object request that reached it, answered or not
        self.slow_bps = 256 << 10
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._started.wait(10)

    def _run(self) -> None:
        import asyncio

        import aiohttp
        from aiohttp import web

        asyncio.set_event_loop(self._loop)

        async def handle(request: web.Request) -> web.StreamResponse:
            is_object = request.path.startswith("/v1/objects/")
            self.object_requests += is_object
            if self.mode == "down":
                request.transport.close()  # a dead edge: the connection drops
                return web.Response(status=503)
            if self.mode == "stall" and is_object:
                await asyncio.sleep(60)
            async with aiohttp.ClientSession(auto_decompress=False) as s:
                async with s.request(request.method, self.target + request.path_qs, data=await request.read(),
                                     headers={k: v for k, v in request.headers.items() if k.lower() != "host"}) as r:
                    body = await r.read()
                    headers = {k: v for k, v in r.headers.items()
                               if k.lower() not in ("content-length", "transfer-encoding", "connection")}
            if is_object and r.status == 200:
                self.objects_served += 1
                if self.mode == "flip":
                    body = bytearray(body)
                    body[len(body) // 2] ^= 0x40  # same length, same headers: only the digest can tell
                    body = bytes(body)
                if self.mode == "slow":  # a link that turned slow: the same bytes, paced (bounded by their size)
                    resp = web.StreamResponse(status=200, headers=headers)
                    resp.content_length = len(body)
                    await resp.prepare(request)
                    step = 16 << 10
                    for i in range(0, len(body), step):
                        await resp.write(body[i:i + step])
                        await asyncio.sleep(step / self.slow_bps)
                    return resp
            return web.Response(status=r.status, body=body, headers=headers)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._started.set()
        self._loop.run_forever()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
