"""``hlopass.patches.Patches``: replacements installed while any user is inside, restored after."""

import threading
import types

from hlopass.patches import Patches


def test_patches_nest_compose_and_restore():
    module = types.SimpleNamespace(f=lambda x: x)
    original = module.f
    outer = Patches(lambda: [(module, "f")], lambda m, name, current: (lambda x: current(x) + 1))
    inner = Patches(lambda: [(module, "f")], lambda m, name, current: (lambda x: current(x) * 10))
    with outer.active():
        assert module.f(1) == 2 and outer.originals()["f"] is original
        with outer.active():          # re-entered: installed once
            assert module.f(1) == 2
        assert module.f(1) == 2       # still installed: one user left
        with inner.active():          # another pass's patch wraps what it finds
            assert module.f(1) == 20
        assert module.f(1) == 2
    assert module.f is original and not outer.originals()


def test_patches_stay_while_another_thread_is_inside():
    module = types.SimpleNamespace(f=lambda: "plain")
    patches = Patches(lambda: [(module, "f")], lambda m, name, current: (lambda: "patched"))
    entered, release = threading.Event(), threading.Event()

    def other():
        with patches.active():
            entered.set()
            release.wait(5)

    thread = threading.Thread(target=other)
    thread.start()
    entered.wait(5)
    with patches.active():
        assert module.f() == "patched"
    assert module.f() == "patched"    # the other thread is still inside
    release.set()
    thread.join()
    assert module.f() == "plain"
