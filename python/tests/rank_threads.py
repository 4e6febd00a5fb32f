"""One thread per rank, for the tests whose ranks share one platform in this process."""

import threading


def on_rank_threads(world, fn):
    """Runs `fn(r)` on a thread for each rank `r` and returns the results in rank order, once
    every thread finished (a minute at most each) without raising; what any raised fails the
    test, with its rank."""
    results, errors = [None] * world, []

    def body(r):
        try:
            results[r] = fn(r)
        except BaseException as e:  # reported below
            errors.append((r, e))

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results
