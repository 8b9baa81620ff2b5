"""Client CPU per SSE event: httpx (h11) vs aiohttp, against the stub server, 64 streams."""
import asyncio, json, sys, time, base64, os
import httpx, aiohttp
from epdserve.bench.stub import StubServer, StubBehavior
N, C, TOK = 128, 64, 128
body = json.dumps({"model": "stub-model", "stream": True, "max_completion_tokens": TOK,
                   "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                    {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(os.urandom(150000)).decode()}}]}]}).encode()
async def run_httpx(url):
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=None), timeout=None, trust_env=False) as c:
        sem = asyncio.Semaphore(C); ev = 0
        async def one():
            nonlocal ev
            async with sem:
                async with c.stream("POST", url, content=body, headers={"content-type": "application/json"}) as r:
                    async for line in r.aiter_lines():
                        ev += 1
                        if line.startswith("data:") and line[5:].strip() != "[DONE]": json.loads(line[5:])
        await asyncio.gather(*(one() for _ in range(N))); return ev
async def run_aiohttp(url):
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)) as s:
        sem = asyncio.Semaphore(C); ev = 0
        async def one():
            nonlocal ev
            async with sem:
                async with s.post(url, data=body, headers={"content-type": "application/json"}) as r:
                    async for line in r.content:
                        ev += 1
                        line = line.decode().rstrip("\r\n")
                        if line.startswith("data:") and line[5:].strip() != "[DONE]": json.loads(line[5:])
        await asyncio.gather(*(one() for _ in range(N))); return ev
if __name__ == "__main__":
    with StubServer(StubBehavior(ttft_s=0.01, itl_s=0.02)) as srv:
        url = srv.url + "/v1/chat/completions"
        for name, fn in [("httpx", run_httpx), ("aiohttp", run_aiohttp)] * 2:
            c0, w0 = time.process_time(), time.perf_counter()
            ev = asyncio.run(fn(url))
            c1, w1 = time.process_time(), time.perf_counter()
            print(f"{name:8s} events {ev} wall {w1-w0:5.2f}s client CPU {c1-c0:5.2f}s = {(c1-c0)/ev*1e6:5.1f} us/event")
    