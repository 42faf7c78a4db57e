from kvstore.serve.server import run

run()
