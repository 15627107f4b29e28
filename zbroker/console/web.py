"""The console's HTTP surface (aiohttp + Jinja2): /metrics, the pages, the actions.

Every page renders from the sampler's latest snapshot (the broker is not asked per
page view); only the record browser and the actions talk to the broker, and only
when someone uses them. Jinja2 autoescapes everything; record bytes go through
`views.show_bytes` first (text only when printable UTF-8, else hex).

An action (a reset, a redrive) is two requests: a GET that shows what would happen (a confirmation
page) and the POST it carries, with `confirm=yes`. The token (when one is set)
comes as a bearer header, or once as ?token=... which sets a SameSite=Strict
cookie; a POST from another origin is refused.
"""

from __future__ import annotations

import asyncio
import functools
import json
from pathlib import Path

import jinja2
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from zbroker.client.redrive import DEFAULT_CURSOR_GROUP, redrive_dead_letters
from zbroker.console import model, views
from zbroker.console.metrics import registry_for
from zbroker.protocol.errors import ZBrokerError

HERE = Path(__file__).parent
COOKIE = "zbroker_console_token"
MAX_BROWSE = 200


def make_app(sampler, link, *, token: str | None = None) -> web.Application:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined)
    env.globals.update(human_ms=views.human_ms, human_bytes=views.human_bytes)
    registry = registry_for(sampler.source)

    @web.middleware
    async def auth(request: web.Request, handler):
        if token and request.query.get("token"):
            if not views.token_ok(token, f"Bearer {request.query['token']}", None):
                raise web.HTTPUnauthorized(text="bad token")
            response = web.HTTPFound(request.rel_url.without_query("token"))
            response.set_cookie(COOKIE, token, httponly=True, samesite="Strict")
            raise response
        if not views.token_ok(token, request.headers.get("Authorization"), request.cookies.get(COOKIE)):
            raise web.HTTPUnauthorized(text="a bearer token is needed (Authorization: Bearer ... or ?token=...)",
                                       headers={"WWW-Authenticate": "Bearer"})
        if request.method == "POST":
            origin = request.headers.get("Origin")
            if origin and origin not in (f"http://{request.host}", f"https://{request.host}"):
                raise web.HTTPForbidden(text="cross-origin action refused")
        return await handler(request)

    def page(name: str, **ctx) -> web.Response:
        snap = sampler.history.latest()
        html = env.get_template(name).render(snap=snap, errors=list(snap.errors) if snap else [], **ctx)
        return web.Response(text=html, content_type="text/html")

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def overview(request: web.Request) -> web.Response:
        snap = sampler.history.latest()
        actors = []
        for a in (snap.actors() if snap else []):
            proc = snap.procs.get(a.get("pid"))
            actors.append({**a, "proc": proc})
        return page("overview.html", actors=actors, topics=model.topic_rows(sampler.history),
                    groups=model.group_rows(sampler.history))

    async def series(request: web.Request) -> web.Response:
        return web.json_response(sampler.history.series())

    async def topics(request: web.Request) -> web.Response:
        return page("topics.html", rows=model.topic_rows(sampler.history))

    async def groups(request: web.Request) -> web.Response:
        return page("groups.html", rows=model.group_rows(sampler.history))

    async def group(request: web.Request) -> web.Response:
        name, snap = known_group(request)
        verdict, per = model.judge_group(sampler.history, name)
        g = snap.groups[name]
        topics = sorted({p["topic"] for p in g.get("partitions", [])} | {t for mem in g.get("members", [])
                                                                         for t in mem.get("topics", [])})
        return page("group.html", g=g, verdict=verdict, per=per, topics=topics,
                    dlqs=views.dead_letter_topics(g, snap.topics), notice=request.query.get("notice"))

    def known_group(request: web.Request):
        """(name, the latest snapshot), or 404 while the console has not sampled that group."""
        name = request.match_info["name"]
        snap = sampler.history.latest()
        if snap is None or name not in snap.groups:
            raise web.HTTPNotFound(text=f"no group {name!r}")
        return name, snap

    async def reset_confirm(request: web.Request) -> web.Response:
        name, snap = known_group(request)
        topic = request.query.get("topic", "")
        try:
            target = views.parse_reset_target(request.query.get("to", ""))
        except ValueError:
            return page("message.html", title="Reset refused",
                        text="the target must be earliest, latest or an offset >= 0", back=f"/groups/{name}")
        parts = [p for p in snap.groups[name].get("partitions", []) if p["topic"] == topic]
        return page("reset_confirm.html", group=name, topic=topic, to=target, parts=parts,
                    members=len(snap.groups[name].get("members", [])))

    async def reset(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        form = await request.post()
        if form.get("confirm") != "yes":
            raise web.HTTPBadRequest(text="an action needs confirm=yes (from its confirmation page)")
        try:
            target = views.parse_reset_target(str(form.get("to", "")))
            result = await link.reset_group(name, str(form.get("topic", "")), target)
        except ValueError:
            raise web.HTTPBadRequest(text="the target must be earliest, latest or an offset >= 0")
        except ZBrokerError as err:
            return page("message.html", title="Reset failed", text=f"{err.code.value}: {err}",
                        back=f"/groups/{name}")
        await sampler.sample_once()  # the page after the action shows its effect
        moved = ", ".join(f"{p}→{o}" for p, o in result.get("partitions", []))
        raise web.HTTPSeeOther(f"/groups/{name}?notice=" + _quote(f"reset {form.get('topic')} to {target}: {moved}"))

    async def redrive_confirm(request: web.Request) -> web.Response:
        name, snap = known_group(request)
        dlq = request.query.get("dlq", "")
        if dlq not in views.dead_letter_topics(snap.groups[name], snap.topics):
            return page("message.html", title="Redrive refused",
                        text=f"{dlq!r} is not a dead-letter topic of group {name}", back=f"/groups/{name}")
        cursor = snap.groups.get(DEFAULT_CURSOR_GROUP) or {}
        done = {p["partition"]: p["committed"] for p in cursor.get("partitions", []) if p["topic"] == dlq}
        parts = [{**p, "redriven_up_to": done.get(p["partition"])} for p in snap.topics[dlq]["partitions"]]
        return page("redrive_confirm.html", group=name, dlq=dlq, parts=parts, cursor=DEFAULT_CURSOR_GROUP)

    async def redrive(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        form = await request.post()
        if form.get("confirm") != "yes":
            raise web.HTTPBadRequest(text="an action needs confirm=yes (from its confirmation page)")
        dlq = str(form.get("dlq", ""))
        try:
            # The redrive is a client of ordinary ops (zbroker.client.redrive): its blocking
            # sockets run on a thread, so the pages and /metrics keep being served meanwhile.
            result = await asyncio.get_running_loop().run_in_executor(
                None, functools.partial(redrive_dead_letters, link.url, dlq, curve=link.curve))
        except ZBrokerError as err:
            return page("message.html", title="Redrive failed", text=f"{err.code.value}: {err}",
                        back=f"/groups/{name}")
        await sampler.sample_once()
        where = ", ".join(f"{n} to {t}" for t, n in sorted(result["by_topic"].items())) or "nothing to redrive"
        left = f"; {len(result['skipped'])} left in place" if result["skipped"] else ""
        raise web.HTTPSeeOther(f"/groups/{name}?notice=" + _quote(
            f"redrove {result['redriven']} dead letter(s) from {dlq}: {where}{left}"))

    async def records(request: web.Request) -> web.Response:
        snap = sampler.history.latest()
        q = request.query
        topic = q.get("topic", "")
        ctx: dict = {"topic": topic, "partition": q.get("partition", "0"), "offset": q.get("offset", ""),
                     "limit": q.get("limit", "20"), "rows": None, "error": None, "log": None,
                     "topic_names": sorted(snap.topics) if snap else []}
        if topic:
            try:
                partition, limit = int(ctx["partition"]), max(1, min(MAX_BROWSE, int(ctx["limit"])))
                desc = (snap.topics.get(topic) if snap else None) or {}
                start = next((p.get("log_start") for p in desc.get("partitions", [])
                              if p.get("partition") == partition), 0) or 0
                offset = int(ctx["offset"]) if ctx["offset"] != "" else start
                recs, log_start, log_end = await link.fetch(topic, partition, offset, limit)
            except ValueError:
                ctx["error"] = "partition, offset and limit are whole numbers"
            except ZBrokerError as err:
                ctx["error"] = f"{err.code.value}: {err}"
            else:
                ctx["log"] = {"start": log_start, "end": log_end, "offset": offset}
                ctx["rows"] = [{"offset": r.offset, "timestamp_ms": r.timestamp_ms, "key": views.show_bytes(r.key),
                                "value": views.show_bytes(r.value),
                                "headers": views.split_headers(r.headers)} for r in recs]
        return page("records.html", **ctx)

    async def snapshot_json(request: web.Request) -> web.Response:
        snap = sampler.history.latest()
        body = {} if snap is None else {"at_s": snap.at_s, "topics": model.topic_rows(sampler.history),
                                        "groups": model.group_rows(sampler.history), "errors": list(snap.errors)}
        return web.Response(text=json.dumps(body, default=str), content_type="application/json")

    app = web.Application(middlewares=[auth])
    app.add_routes([
        web.get("/metrics", metrics), web.get("/", overview), web.get("/api/series", series),
        web.get("/api/snapshot", snapshot_json),
        web.get("/topics", topics), web.get("/groups", groups), web.get("/groups/{name}", group),
        web.get("/groups/{name}/reset", reset_confirm), web.post("/groups/{name}/reset", reset),
        web.get("/groups/{name}/redrive", redrive_confirm), web.post("/groups/{name}/redrive", redrive),
        web.get("/records", records), web.static("/static", HERE / "static"),
    ])
    return app


def _quote(text: str) -> str:
    from urllib.parse import quote
    return quote(text, safe="")
