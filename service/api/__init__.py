"""The OpenAI-compatible HTTP api: stateless replicas in front of one scheduler."""

from service.api.app import create_app, run_api

__all__ = ["create_app", "run_api"]
