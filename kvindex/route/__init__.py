"""``kvindex route``: an OpenAI-compatible routing proxy in front of engines (README.md here).

``kvindex.route.proxy`` holds RouteProxy and RouteConfig; it needs aiohttp (the ``route`` extra),
so this package imports nothing by itself and the rest of the command line works without it.
"""
