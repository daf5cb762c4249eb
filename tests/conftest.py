import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import children  # noqa: E402


def pytest_collection_finish(session):
    children.start(session.items)


def pytest_sessionfinish(session):
    children.stop()
