"""A Ray Serve config file (``ray_configs/serve.yaml``, ``autoscale.yaml``) as ``eyas serve --config``
and ``eyas experiment autoscale --serve-config`` apply it: the Eyas application's ``args``, its
``route_prefix`` and ``deployments:`` options, the proxies' addresses and ``proxy_location``.

The file is checked by Ray Serve's own schema (``ray.serve.schema.ServeDeploySchema``) and then by what
Eyas can apply: every field it cannot apply is refused, naming it and saying what does the same
(a replica count of ``EyasTarget`` is the ``target_replicas`` arg), never ignored. ``serve deploy FILE``
(Serve's own path, with a dashboard) applies the same file whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

APP_NAME = "eyas"
IMPORT_PATH = "eyas.serve.app:build_app"
DEPLOYMENTS = ("EyasServer", "EyasTarget", "EyasDrafter")
# deployment options any of Eyas's deployments takes from a file
PLAIN_OPTIONS = (
    "max_ongoing_requests",
    "max_queued_requests",
    "health_check_period_s",
    "health_check_timeout_s",
    "graceful_shutdown_wait_loop_s",
    "graceful_shutdown_timeout_s",
)
# options the app's args own for the target and drafter deployments: option -> the arg that sets it
ARG_OWNED = {
    "num_replicas": "{kind}_replicas",
    "autoscaling_config": "{kind}_autoscaling",
    "ray_actor_options": "{kind}_num_cpus, {kind}_num_gpus and {kind}_resources",
    "request_router_config": "target_router",
}
TOP_LEVEL = ("proxy_location", "http_options", "grpc_options", "applications")
APP_FIELDS = ("name", "route_prefix", "import_path", "args", "deployments")


@dataclass(frozen=True, kw_only=True)
class ServeFile:
    """What Eyas applies of a Serve config file."""

    args: dict = field(default_factory=dict)  # the eyas application's args (checked by eyas.serve.config)
    endpoints: dict = field(default_factory=dict)  # host / http_port / grpc_port, where the file sets them
    route_prefix: str = "/"
    proxy_location: str | None = None  # None: Serve's default
    deployment_options: dict = field(default_factory=dict)  # deployment name -> options to apply


def read_serve_file(path: str | Path) -> ServeFile:
    """Read and check a Serve config file; a ``ValueError`` naming the file and the field for anything
    it cannot be or Eyas cannot apply."""
    doc = _read(path)
    where = str(path)
    extra = sorted(set(doc) - set(TOP_LEVEL))
    if extra:
        raise ValueError(
            f"{where}: {extra[0]}: eyas serve does not apply it (it applies {', '.join(TOP_LEVEL)}); "
            "use `serve deploy` for the rest of Serve's config"
        )
    apps = doc.get("applications") or []
    if not isinstance(apps, list) or not all(isinstance(a, dict) for a in apps):
        raise ValueError(f"{where}: applications: must be a list of mappings")
    others = [a.get("name") for a in apps if a.get("name", APP_NAME) != APP_NAME]
    if others:
        raise ValueError(
            f"{where}: applications[{others[0]}]: eyas serve runs the {APP_NAME!r} application only "
            "(deploy the others with `serve deploy`)"
        )
    if not apps:
        raise ValueError(f"{where}: applications: no application named {APP_NAME!r}")
    app = apps[0]
    extra = sorted(set(app) - set(APP_FIELDS))
    if extra:
        raise ValueError(f"{where}: applications[{APP_NAME}].{extra[0]}: eyas serve does not apply it")
    if app.get("import_path", IMPORT_PATH) != IMPORT_PATH:
        raise ValueError(
            f"{where}: applications[{APP_NAME}].import_path: must be {IMPORT_PATH}, got {app['import_path']!r}"
        )
    args = app.get("args") or {}
    if not isinstance(args, dict):
        raise ValueError(f"{where}: applications[{APP_NAME}].args: must be a mapping, got {type(args).__name__}")
    _serve_schema(doc, app, where)
    return ServeFile(
        args=dict(args),
        endpoints=_endpoints(doc, where),
        route_prefix=app.get("route_prefix") or "/",
        proxy_location=doc.get("proxy_location"),
        deployment_options=_deployment_options(app.get("deployments") or [], where),
    )


def _read(path: str | Path) -> dict:
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except OSError as err:
        raise ValueError(f"{path}: cannot read it ({err.strerror})") from None
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML ({err})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a Serve config is a mapping with an `applications` list, got {type(doc).__name__}")
    return doc


def _serve_schema(doc: dict, app: dict, where: str) -> None:
    """Ray Serve's own check of the file (the eyas app's import_path filled in when the file omits it)."""
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    filled = {**doc, "applications": [{"import_path": IMPORT_PATH, **app}]}
    try:
        ServeDeploySchema.model_validate(filled)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        raise ValueError(f"{where}: {loc}: {first['msg']}") from None


def _endpoints(doc: dict, where: str) -> dict:
    found = {}
    for section, allowed in (("http_options", ("host", "port")), ("grpc_options", ("port", "grpc_servicer_functions"))):
        options = doc.get(section) or {}
        if not isinstance(options, dict):
            raise ValueError(f"{where}: {section}: must be a mapping")
        extra = sorted(set(options) - set(allowed))
        if extra:
            raise ValueError(
                f"{where}: {section}.{extra[0]}: eyas serve does not apply it (it sets {', '.join(allowed)})"
            )
    for section, key, name in (
        ("http_options", "host", "host"),
        ("http_options", "port", "http_port"),
        ("grpc_options", "port", "grpc_port"),
    ):
        value = (doc.get(section) or {}).get(key)
        if value is None:
            continue
        if name != "host" and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535):
            raise ValueError(f"{where}: {section}.{key}: must be a port number in [1, 65535], got {value!r}")
        found[name] = value
    return found


def _deployment_options(entries: list, where: str) -> dict:
    out: dict[str, dict] = {}
    if not isinstance(entries, list):
        raise ValueError(f"{where}: applications[{APP_NAME}].deployments: must be a list of mappings")
    for entry in entries:
        name = entry.get("name") if isinstance(entry, dict) else None
        at = f"{where}: applications[{APP_NAME}].deployments[{name}]"
        if name not in DEPLOYMENTS:
            raise ValueError(f"{at}: not one of Eyas's deployments {list(DEPLOYMENTS)}")
        options = {k: v for k, v in entry.items() if k != "name"}
        for key in options:
            if key in PLAIN_OPTIONS or (name == "EyasServer" and key == "num_replicas"):
                continue
            if key in ARG_OWNED and name != "EyasServer":
                kind = "target" if name == "EyasTarget" else "drafter"
                raise ValueError(f"{at}.{key}: set by the app's args ({ARG_OWNED[key].format(kind=kind)})")
            raise ValueError(f"{at}.{key}: eyas serve does not apply it (it applies {', '.join(PLAIN_OPTIONS)})")
        out[name] = options
    return out
