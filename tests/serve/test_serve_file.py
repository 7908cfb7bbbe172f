"""A Serve config file as `eyas serve --config` applies it (eyas.serve.serve_file): the shipped files
whole; every field Eyas cannot apply refused, naming it; Serve's own schema checks the rest."""

from __future__ import annotations

from pathlib import Path

import pytest

from eyas.serve.app import build_app
from eyas.serve.serve_file import read_serve_file

REPO = Path(__file__).resolve().parents[2]


def test_the_shipped_files_apply_whole():
    served = read_serve_file(REPO / "ray_configs" / "serve.yaml")
    assert served.args["methods"] and served.route_prefix == "/" and served.proxy_location == "HeadOnly"
    assert served.endpoints == {"host": "127.0.0.1", "http_port": 8000, "grpc_port": 9000}
    assert served.deployment_options == {"EyasServer": {"num_replicas": 1, "max_ongoing_requests": 256}}
    auto = read_serve_file(REPO / "ray_configs" / "autoscale.yaml")
    assert auto.args["target_autoscaling"]["policy"] and "EyasServer" in auto.deployment_options


def test_deployment_options_reach_the_deployments(tmp_path):
    """A file's options over the args' own: the ingress's queue bound, the target's health check."""
    path = tmp_path / "serve.yaml"
    path.write_text(
        "applications:\n"
        "  - name: eyas\n"
        "    route_prefix: /eyas\n"
        "    args: {methods: [], drafter_replicas: 0}\n"
        "    deployments:\n"
        "      - {name: EyasServer, max_ongoing_requests: 64}\n"
        "      - {name: EyasTarget, health_check_period_s: 5}\n"
    )
    served = read_serve_file(path)
    assert served.route_prefix == "/eyas"
    app = build_app(served.args, served.deployment_options)
    ingress = app._bound_deployment  # Serve's Application -> its bound Deployment
    assert ingress.max_ongoing_requests == 64
    target = ingress.init_args[1]._bound_deployment
    assert target._deployment_config.health_check_period_s == 5
    assert target.num_replicas == 1  # the args' own count stays


@pytest.mark.parametrize(
    "text, named",
    [
        ("logging_config: {}\napplications: [{name: eyas}]", "logging_config: eyas serve does not apply it"),
        ("applications: [{name: eyas}, {name: other, import_path: a:b}]", "applications[other]: eyas serve runs"),
        ("applications: [{name: eyas, runtime_env: {}}]", "applications[eyas].runtime_env: eyas serve does not"),
        ("applications: [{name: eyas, import_path: other:app}]", "applications[eyas].import_path: must be"),
        (
            "applications: [{name: eyas, deployments: [{name: EyasTarget, num_replicas: 2}]}]",
            "deployments[EyasTarget].num_replicas: set by the app's args (target_replicas)",
        ),
        (
            "applications: [{name: eyas, deployments: [{name: EyasDrafter, ray_actor_options: {}}]}]",
            "deployments[EyasDrafter].ray_actor_options: set by the app's args (drafter_num_cpus",
        ),
        ("applications: [{name: eyas, deployments: [{name: Other}]}]", "deployments[Other]: not one of Eyas's"),
        (
            "applications: [{name: eyas, deployments: [{name: EyasServer, user_config: {}}]}]",
            "deployments[EyasServer].user_config: eyas serve does not apply it",
        ),
        ("http_options: {request_timeout_s: 5}\napplications: [{name: eyas}]", "http_options.request_timeout_s"),
        (
            "applications: [{name: eyas, deployments: [{name: EyasServer, num_replicas: many}]}]",
            "applications.0.deployments.0",  # Serve's own schema
        ),
        ("applications: []", "applications: no application named 'eyas'"),
    ],
)
def test_what_cannot_be_applied_is_refused_naming_it(tmp_path, text, named):
    path = tmp_path / "serve.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ValueError) as err:
        read_serve_file(path)
    assert str(err.value).startswith(f"{path}: ") and named in str(err.value), str(err.value)
