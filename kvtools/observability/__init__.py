"""What an operator sees: Grafana dashboards and Prometheus alerting rules as code (``dashboards.py``,
``alerts.py``), rendered to ``deploy/observability/`` by ``python -m kvtools.observability.generate``."""
