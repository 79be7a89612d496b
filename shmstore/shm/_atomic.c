/* shmstore.shm._atomic: ordered access to aligned 8-byte words of a shared mapping.
 *
 * The compiled form of shm/_ordering.py's OrderedWords, built at install time where a C
 * compiler exists (setup.py marks it optional; without it the pure-Python OrderedWords is used).
 * One call is one C function: no ctypes argument conversion, which costs about 1 us per call on
 * a warm CPU and tens of microseconds on a cold one (a reader just woken, a writer after an idle
 * period), where every page the call touches misses the caches again.
 *
 *   Words(buffer)                        export a writable buffer (an mmap) until release()
 *   load_acquire(offset) -> int          __atomic_load_n, acquire
 *   store_release(offset, value)         __atomic_store_n, release (value taken mod 2**64)
 *   exchange(offset, value) -> int       __atomic_exchange_n, seq_cst (a full barrier)
 *   compare_exchange(offset, expected, value) -> bool    seq_cst
 *   release()                            drop the export (idempotent); later calls raise
 *
 * Every offset is checked: a multiple of 8 inside the buffer (IndexError otherwise), so a word
 * offset computed from damaged bytes raises instead of touching memory outside the mapping.
 *
 * The GIL: every call keeps it, so release() (from another thread) never runs while an
 *   access is under way: a word is never touched after its mapping may have closed. Each access
 *   is one instruction; letting the GIL go around it would cost more than the access.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int exported;
} WordsObject;

/* The word at `arg`, checked. Callers convert every other argument first: a conversion may
 * run Python code (__index__) that releases the words, and nothing may run between the release
 * check here and the atomic operation on the pointer it returns. */
static uint64_t *
word_at(WordsObject *self, PyObject *arg)
{
    Py_ssize_t offset = PyLong_AsSsize_t(arg);  /* ints only: no Python code runs */
    if (offset == -1 && PyErr_Occurred())
        return NULL;
    if (!self->exported) {
        PyErr_SetString(PyExc_ValueError, "the words were released (their mapping is closed)");
        return NULL;
    }
    if (offset < 0 || offset % 8 != 0 || offset > self->view.len - 8) {
        PyErr_Format(PyExc_IndexError,
                     "word offset %zd is not a multiple of 8 inside the %zd-byte mapping",
                     offset, self->view.len);
        return NULL;
    }
    return (uint64_t *)((char *)self->view.buf + offset);
}

static int
value_arg(PyObject *arg, uint64_t *out)
{
    unsigned long long value = PyLong_AsUnsignedLongLongMask(arg);
    if (value == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = (uint64_t)value;
    return 0;
}

static int
check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t expected)
{
    if (nargs != expected) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, expected,
                     nargs);
        return -1;
    }
    return 0;
}

static PyObject *
words_load_acquire(WordsObject *self, PyObject *offset)
{
    uint64_t *word = word_at(self, offset);
    if (word == NULL)
        return NULL;
    return PyLong_FromUnsignedLongLong(__atomic_load_n(word, __ATOMIC_ACQUIRE));
}

static PyObject *
words_store_release(WordsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t value;
    if (check_nargs("store_release", nargs, 2) < 0)
        return NULL;
    if (value_arg(args[1], &value) < 0)
        return NULL;
    uint64_t *word = word_at(self, args[0]);
    if (word == NULL)
        return NULL;
    __atomic_store_n(word, value, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

static PyObject *
words_exchange(WordsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t value;
    if (check_nargs("exchange", nargs, 2) < 0)
        return NULL;
    if (value_arg(args[1], &value) < 0)
        return NULL;
    uint64_t *word = word_at(self, args[0]);
    if (word == NULL)
        return NULL;
    return PyLong_FromUnsignedLongLong(__atomic_exchange_n(word, value, __ATOMIC_SEQ_CST));
}

static PyObject *
words_compare_exchange(WordsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t expected, value;
    if (check_nargs("compare_exchange", nargs, 3) < 0)
        return NULL;
    if (value_arg(args[1], &expected) < 0 || value_arg(args[2], &value) < 0)
        return NULL;
    uint64_t *word = word_at(self, args[0]);
    if (word == NULL)
        return NULL;
    int done = __atomic_compare_exchange_n(word, &expected, value, 0, __ATOMIC_SEQ_CST,
                                           __ATOMIC_SEQ_CST);
    return PyBool_FromLong(done);
}

static PyObject *
words_release(WordsObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->exported) {
        self->exported = 0;
        PyBuffer_Release(&self->view);
    }
    Py_RETURN_NONE;
}

static int
words_init(WordsObject *self, PyObject *args, PyObject *kwargs)
{
    PyObject *source;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) > 0) {
        PyErr_SetString(PyExc_TypeError, "Words() takes no keyword arguments");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "O:Words", &source))
        return -1;
    if (self->exported) {
        self->exported = 0;
        PyBuffer_Release(&self->view);
    }
    if (PyObject_GetBuffer(source, &self->view, PyBUF_WRITABLE | PyBUF_SIMPLE) < 0)
        return -1;
    if (((uintptr_t)self->view.buf) % 8 != 0) {
        PyBuffer_Release(&self->view);
        PyErr_SetString(PyExc_ValueError, "the buffer is not 8-byte aligned");
        return -1;
    }
    self->exported = 1;
    return 0;
}

static void
words_dealloc(WordsObject *self)
{
    if (self->exported) {
        self->exported = 0;
        PyBuffer_Release(&self->view);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef words_methods[] = {
    {"load_acquire", (PyCFunction)words_load_acquire, METH_O,
     "Return the u64 at byte `offset`; later reads happen after it."},
    {"store_release", (PyCFunction)(void (*)(void))words_store_release, METH_FASTCALL,
     "Store `value` (mod 2**64) at byte `offset` after all earlier accesses."},
    {"exchange", (PyCFunction)(void (*)(void))words_exchange, METH_FASTCALL,
     "Swap in `value` at byte `offset` with a full barrier; return the old value."},
    {"compare_exchange", (PyCFunction)(void (*)(void))words_compare_exchange, METH_FASTCALL,
     "Store `value` at byte `offset` if it holds `expected` (seq_cst); say whether it did."},
    {"release", (PyCFunction)words_release, METH_NOARGS,
     "Drop the export of the mapping so that it can be closed; idempotent."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject WordsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmstore.shm._atomic.Words",
    .tp_doc = "Aligned 8-byte words of one writable buffer, with ordered access.",
    .tp_basicsize = sizeof(WordsObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)words_init,
    .tp_dealloc = (destructor)words_dealloc,
    .tp_methods = words_methods,
};

static struct PyModuleDef atomic_module = {
    PyModuleDef_HEAD_INIT, "shmstore.shm._atomic",
    "Ordered access to aligned 8-byte words of a shared mapping (see _atomic.c).", -1, NULL,
};

PyMODINIT_FUNC
PyInit__atomic(void)
{
    if (PyType_Ready(&WordsType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&atomic_module);
    if (module == NULL)
        return NULL;
    Py_INCREF(&WordsType);
    if (PyModule_AddObject(module, "Words", (PyObject *)&WordsType) < 0) {
        Py_DECREF(&WordsType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
