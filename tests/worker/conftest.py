from tests.model.conftest import _single_torch_thread as _single_torch_thread  # one thread: see there
