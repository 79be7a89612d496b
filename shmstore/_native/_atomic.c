/* shmstore._native._atomic: ordered access to aligned 8-byte words of a shared mapping.
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
 * Slots(words, layout, row, post, wait)   a broadcast queue's slots, written and read in one
 *                                        call per step (queue/_layout.py draws the layout;
 *                                        `layout` maps each LAYOUT name below to its number)
 *
 * The GIL: every call keeps it, so release() (from another thread) never runs while an
 *   access is under way: a word is never touched after its mapping may have closed. Each access
 *   is one instruction; letting the GIL go around it would cost more than the access.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <semaphore.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <limits.h>
#include <zlib.h>

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
    .tp_name = "shmstore._native._atomic.Words",
    .tp_doc = "Aligned 8-byte words of one writable buffer, with ordered access.",
    .tp_basicsize = sizeof(WordsObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)words_init,
    .tp_dealloc = (destructor)words_dealloc,
    .tp_methods = words_methods,
};

/* ---- Slots: a broadcast queue's hand-off in one call per step ------------------------------
 *
 * The same steps as queue/_writer.py and queue/_broadcast.py take in Python, on the layout
 * queue/_layout.py draws; `layout` is its handoff_layout(), a dict keyed by the names below,
 * checked against the mapping here, so the two paths read and write the same bytes.
 *
 *   Slots(words, layout, row, post, wait)
 *       words   the queue segment's Words (kept; calls fail once they are released)
 *       row     this reader's row offset, or -1 for the writer
 *       post    doorbell names this side posts: the writer, each reader's in index order;
 *               a reader, the writer's
 *       wait    the doorbell a reader sleeps on (None for the writer)
 *   publish(seq, tag, body)   writer: copy `body` (a buffer; an int: that many bytes are in the
 *                             slot already), CRC, fields, seq with release order, write_seq with
 *                             a full barrier, then post each sleeping reader's doorbell
 *   take(seq) -> None | (tag, nbytes) | 1 | 2
 *                             reader: None while message `seq` is not in its slot; 1: its size
 *                             is larger than a slot; 2: its CRC is wrong
 *   finish(seq) -> bool       reader: False if the slot no longer holds `seq` (nothing done);
 *                             else consume it (read_seq, full barrier) and post the writer's
 *                             doorbell if it sleeps
 *   sleep(seq, seconds) -> bool
 *                             reader: the doorbell handshake of shm/_wait.py ("I am asleep",
 *                             re-check, wait without the GIL, "awake"); whether `seq` arrived.
 *                             A signal ends the wait early (its handler runs; one that raises
 *                             raises here)
 *   release()                 close the doorbells (after a sleep in flight ends); idempotent
 *
 * The CRC is zlib's, linked here (the Python path calls it through zlib.crc32). Every call
 * checks that the words are still exported; the queue's CallGuard keeps release() from running
 * while a call is in flight, and a sleep in flight defers the closing of its doorbell to its end.
 */
/* The layout, by name: queue/_layout.py's handoff_layout() is a dict with exactly these keys
 * (Slots() refuses a missing or an extra one), so the two sides cannot agree by position only.
 * The enum and the names come from this one list: a reorder here changes both. */
#define HANDOFF_LAYOUT(X) \
    X(WRITE_SEQ, "write_seq") X(CLOSED, "closed") X(WRITER_SLEEPING, "writer_sleeping") \
    X(TABLE, "table") X(ROW_BYTES, "row_bytes") X(ROW_READ_SEQ, "row_read_seq") \
    X(ROW_SLEEPING, "row_sleeping") X(DATA, "data") X(STRIDE, "stride") \
    X(N_SLOTS, "n_slots") X(SLOT_BYTES, "slot_bytes") X(SLOT_NBYTES, "slot_nbytes") \
    X(SLOT_TAG, "slot_tag") X(SLOT_CRC, "slot_crc") X(BODY, "body")
#define LAYOUT_ENUM(id, text) L_##id,
#define LAYOUT_NAME(id, text) text,
enum { HANDOFF_LAYOUT(LAYOUT_ENUM) L_COUNT };
static const char *const layout_names[L_COUNT] = { HANDOFF_LAYOUT(LAYOUT_NAME) };

typedef struct {
    PyObject_HEAD
    WordsObject *words;
    Py_ssize_t at[L_COUNT];
    Py_ssize_t row;
    Py_ssize_t n_post;
    sem_t **post;
    sem_t *wait;
    int sleeping;
    int released;
} SlotsObject;

static void
put_le(unsigned char *to, uint64_t value, int nbytes)
{
    for (int i = 0; i < nbytes; i++)
        to[i] = (unsigned char)(value >> (8 * i));
}

static uint64_t
get_le(const unsigned char *from, int nbytes)
{
    uint64_t value = 0;
    for (int i = nbytes - 1; i >= 0; i--)
        value = (value << 8) | from[i];
    return value;
}

static char *
slots_base(SlotsObject *self)
{
    if (self->released || self->words == NULL || !self->words->exported) {
        PyErr_SetString(PyExc_ValueError, "the queue's slots were released (it is closed)");
        return NULL;
    }
    return (char *)self->words->view.buf;
}

static uint64_t *
word(char *base, Py_ssize_t offset)
{
    return (uint64_t *)(base + offset);
}

static char *
slot_of(SlotsObject *self, char *base, uint64_t seq)
{
    return base + self->at[L_DATA] + (Py_ssize_t)((seq - 1) % (uint64_t)self->at[L_N_SLOTS])
           * self->at[L_STRIDE];
}

/* CRC-32 (zlib's) of the slot's size and tag, as queue/_layout.py's SIZE_TAG packs them, then
 * of its payload: the value message_crc() computes there. */
static uint32_t
slot_crc(const char *payload, uint64_t nbytes, uint32_t tag)
{
    unsigned char head[12];
    put_le(head, nbytes, 8);
    put_le(head + 8, tag, 4);
    uLong crc = crc32(crc32(0L, Z_NULL, 0), head, sizeof head);
    for (uint64_t done = 0; done < nbytes; ) {  /* zlib takes at most UINT_MAX bytes a call */
        uInt part = nbytes - done > UINT_MAX ? UINT_MAX : (uInt)(nbytes - done);
        crc = crc32(crc, (const Bytef *)payload + done, part);
        done += part;
    }
    return (uint32_t)crc;
}

/* Post `bell` if the flag word at `flag` says its owner sleeps (the waker's side of the
 * handshake); -1 with OSError set if the post failed. */
static int
wake(char *base, Py_ssize_t flag, sem_t *bell)
{
    if (__atomic_load_n(word(base, flag), __ATOMIC_ACQUIRE)
            && __atomic_exchange_n(word(base, flag), 0, __ATOMIC_SEQ_CST)
            && sem_post(bell) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}

static int
seq_arg(PyObject *arg, uint64_t *seq)
{
    unsigned long long value = PyLong_AsUnsignedLongLong(arg);
    if (value == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    if (value == 0) {
        PyErr_SetString(PyExc_ValueError, "message numbers start at 1");
        return -1;
    }
    *seq = (uint64_t)value;
    return 0;
}

static int
role(SlotsObject *self, int reader, const char *name)
{
    if ((self->row >= 0) != reader) {
        PyErr_Format(PyExc_TypeError, "%s() is for the queue's %s", name,
                     reader ? "readers" : "writer");
        return -1;
    }
    return 0;
}

static PyObject *
slots_publish(SlotsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t seq, nbytes;
    Py_buffer body = {0};
    if (check_nargs("publish", nargs, 3) < 0 || role(self, 0, "publish") < 0
            || seq_arg(args[0], &seq) < 0)
        return NULL;
    unsigned long tag = PyLong_AsUnsignedLong(args[1]);
    if (tag == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    if (tag > 0xFFFFFFFFUL) {
        PyErr_Format(PyExc_OverflowError, "tag %lu does not fit in 32 bits", tag);
        return NULL;
    }
    if (PyLong_Check(args[2])) {
        nbytes = PyLong_AsUnsignedLongLong(args[2]);
        if (nbytes == (uint64_t)-1 && PyErr_Occurred())
            return NULL;
    } else {
        if (PyObject_GetBuffer(args[2], &body, PyBUF_SIMPLE) < 0)
            return NULL;
        nbytes = (uint64_t)body.len;
    }
    if (nbytes > (uint64_t)self->at[L_SLOT_BYTES]) {
        PyErr_Format(PyExc_ValueError, "a body of %llu bytes does not fit a %zd-byte slot",
                     (unsigned long long)nbytes, self->at[L_SLOT_BYTES]);
        goto fail;
    }
    char *base = slots_base(self);
    if (base == NULL)
        goto fail;
    char *slot = slot_of(self, base, seq);
    char *payload = slot + self->at[L_BODY];
    if (body.buf != NULL) {
        memcpy(payload, body.buf, (size_t)nbytes);
        PyBuffer_Release(&body);
    }
    uint32_t crc = slot_crc(payload, nbytes, (uint32_t)tag);
    put_le((unsigned char *)slot + self->at[L_SLOT_NBYTES], nbytes, 8);
    put_le((unsigned char *)slot + self->at[L_SLOT_TAG], tag, 4);
    put_le((unsigned char *)slot + self->at[L_SLOT_CRC], crc, 4);
    __atomic_store_n((uint64_t *)slot, seq, __ATOMIC_RELEASE);  /* published */
    __atomic_exchange_n(word(base, self->at[L_WRITE_SEQ]), seq, __ATOMIC_SEQ_CST);
    int failed = 0;
    for (Py_ssize_t r = 0; r < self->n_post; r++) {
        Py_ssize_t flag = self->at[L_TABLE] + r * self->at[L_ROW_BYTES] + self->at[L_ROW_SLEEPING];
        if (wake(base, flag, self->post[r]) < 0) {
            if (failed)  /* keep the first error; wake every other reader */
                PyErr_Clear();
            failed = 1;
        }
    }
    if (failed)
        return NULL;
    Py_RETURN_NONE;
fail:
    if (body.buf != NULL)
        PyBuffer_Release(&body);
    return NULL;
}

static PyObject *
slots_take(SlotsObject *self, PyObject *arg)
{
    uint64_t seq;
    if (role(self, 1, "take") < 0 || seq_arg(arg, &seq) < 0)
        return NULL;
    char *base = slots_base(self);
    if (base == NULL)
        return NULL;
    char *slot = slot_of(self, base, seq);
    if (__atomic_load_n((uint64_t *)slot, __ATOMIC_ACQUIRE) != seq)
        Py_RETURN_NONE;
    uint64_t nbytes = get_le((unsigned char *)slot + self->at[L_SLOT_NBYTES], 8);
    uint32_t tag = (uint32_t)get_le((unsigned char *)slot + self->at[L_SLOT_TAG], 4);
    uint32_t crc = (uint32_t)get_le((unsigned char *)slot + self->at[L_SLOT_CRC], 4);
    if (nbytes > (uint64_t)self->at[L_SLOT_BYTES])
        return PyLong_FromLong(1);
    if (slot_crc(slot + self->at[L_BODY], nbytes, tag) != crc)
        return PyLong_FromLong(2);
    return Py_BuildValue("(kK)", (unsigned long)tag, (unsigned long long)nbytes);
}

static PyObject *
slots_finish(SlotsObject *self, PyObject *arg)
{
    uint64_t seq;
    if (role(self, 1, "finish") < 0 || seq_arg(arg, &seq) < 0)
        return NULL;
    char *base = slots_base(self);
    if (base == NULL)
        return NULL;
    if (__atomic_load_n((uint64_t *)slot_of(self, base, seq), __ATOMIC_ACQUIRE) != seq)
        Py_RETURN_FALSE;
    __atomic_exchange_n(word(base, self->row + self->at[L_ROW_READ_SEQ]), seq, __ATOMIC_SEQ_CST);
    if (wake(base, self->at[L_WRITER_SLEEPING], self->post[0]) < 0)
        return NULL;
    Py_RETURN_TRUE;
}

static void
close_bells(SlotsObject *self)
{
    for (Py_ssize_t r = 0; r < self->n_post; r++)
        if (self->post[r] != NULL && self->post[r] != SEM_FAILED)
            sem_close(self->post[r]);
    PyMem_Free(self->post);
    self->post = NULL;
    self->n_post = 0;
    if (self->wait != NULL && self->wait != SEM_FAILED)
        sem_close(self->wait);
    self->wait = NULL;
}

static PyObject *
slots_sleep(SlotsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t seq;
    if (check_nargs("sleep", nargs, 2) < 0 || role(self, 1, "sleep") < 0
            || seq_arg(args[0], &seq) < 0)
        return NULL;
    double seconds = PyFloat_AsDouble(args[1]);
    if (seconds == -1.0 && PyErr_Occurred())
        return NULL;
    if (!(seconds >= 0.0 && seconds <= 86400.0)) {
        PyErr_Format(PyExc_ValueError, "cannot sleep %g s", seconds);
        return NULL;
    }
    char *base = slots_base(self);
    if (base == NULL)
        return NULL;
    Py_ssize_t flag = self->row + self->at[L_ROW_SLEEPING];
    uint64_t *seq_word = (uint64_t *)slot_of(self, base, seq);
    __atomic_exchange_n(word(base, flag), 1, __ATOMIC_SEQ_CST);  /* "I am asleep", a barrier */
    if (__atomic_load_n(seq_word, __ATOMIC_ACQUIRE) == seq
            || __atomic_load_n(word(base, self->at[L_CLOSED]), __ATOMIC_ACQUIRE)) {
        __atomic_exchange_n(word(base, flag), 0, __ATOMIC_SEQ_CST);
        Py_RETURN_TRUE;
    }
    /* A deadline on the monotonic clock where the C library can wait on it (glibc 2.30+):
       a wall-clock step (NTP, an admin) neither stretches nor cuts the sleep. */
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 30))
#define SHMSTORE_SLEEP_CLOCK CLOCK_MONOTONIC
#else
#define SHMSTORE_SLEEP_CLOCK CLOCK_REALTIME
#endif
    struct timespec until;
    clock_gettime(SHMSTORE_SLEEP_CLOCK, &until);
    double whole = (double)(long long)seconds;
    until.tv_sec += (time_t)whole;
    until.tv_nsec += (long)((seconds - whole) * 1e9);
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec += 1;
        until.tv_nsec -= 1000000000L;
    }
    sem_t *bell = self->wait;
    int rc, err;
    self->sleeping++;
    Py_BEGIN_ALLOW_THREADS
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 30))
    rc = sem_clockwait(bell, CLOCK_MONOTONIC, &until);
#else
    rc = sem_timedwait(bell, &until);
#endif
    err = errno;
    Py_END_ALLOW_THREADS
    self->sleeping--;
    if (self->released && self->sleeping == 0)
        close_bells(self);  /* released while asleep: the bells were left to the last sleeper */
    if ((base = slots_base(self)) == NULL)
        return NULL;
    __atomic_exchange_n(word(base, flag), 0, __ATOMIC_SEQ_CST);
    if (rc != 0 && err == EINTR) {
        if (PyErr_CheckSignals() < 0)  /* a handler that raised ends the wait with its error */
            return NULL;
    } else if (rc != 0 && err != ETIMEDOUT) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyBool_FromLong(__atomic_load_n(seq_word, __ATOMIC_ACQUIRE) == seq);
}

static PyObject *
slots_release(SlotsObject *self, PyObject *Py_UNUSED(ignored))
{
    self->released = 1;
    if (self->sleeping == 0)
        close_bells(self);
    Py_CLEAR(self->words);
    Py_RETURN_NONE;
}

static sem_t *
open_bell(PyObject *name)
{
    const char *text = PyUnicode_AsUTF8(name);
    if (text == NULL)
        return NULL;
    sem_t *bell = sem_open(text, 0);
    if (bell == SEM_FAILED) {
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, name);
        return NULL;
    }
    return bell;
}

static int
slots_init(SlotsObject *self, PyObject *args, PyObject *kwargs)
{
    PyObject *words, *layout, *post, *wait;
    Py_ssize_t row;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) > 0) {
        PyErr_SetString(PyExc_TypeError, "Slots() takes no keyword arguments");
        return -1;
    }
    if (self->words != NULL || self->post != NULL) {
        PyErr_SetString(PyExc_TypeError, "Slots() is made once");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "O!O!nO!O:Slots", &WordsType, &words, &PyDict_Type, &layout,
                          &row, &PyTuple_Type, &post, &wait))
        return -1;
    WordsObject *w = (WordsObject *)words;
    if (!w->exported) {
        PyErr_SetString(PyExc_ValueError, "the words were released (their mapping is closed)");
        return -1;
    }
    for (int i = 0; i < L_COUNT; i++) {
        PyObject *number = PyDict_GetItemString(layout, layout_names[i]);  /* borrowed */
        if (number == NULL) {
            PyErr_Format(PyExc_ValueError, "the layout lacks %s (queue/_layout.py and "
                         "_atomic.c disagree: rebuild shmstore)", layout_names[i]);
            return -1;
        }
        self->at[i] = PyLong_AsSsize_t(number);
        if (self->at[i] == -1 && PyErr_Occurred())
            return -1;
        if (self->at[i] < 0) {
            PyErr_Format(PyExc_ValueError, "layout number %s is negative", layout_names[i]);
            return -1;
        }
    }
    if (PyDict_GET_SIZE(layout) != L_COUNT) {
        PyErr_Format(PyExc_ValueError, "the layout has %zd names, not the %d this build knows "
                     "(queue/_layout.py and _atomic.c disagree: rebuild shmstore)",
                     PyDict_GET_SIZE(layout), L_COUNT);
        return -1;
    }
    Py_ssize_t n_post = PyTuple_GET_SIZE(post), len = w->view.len, *at = self->at;
    Py_ssize_t n_rows = row < 0 ? n_post : 0;  /* the writer posts every reader's row */
    int bad = at[L_N_SLOTS] < 1 || at[L_SLOT_BYTES] < 1 || at[L_BODY] < 24
        || at[L_SLOT_NBYTES] < 8 || at[L_SLOT_NBYTES] + 8 > at[L_BODY]
        || at[L_SLOT_TAG] < 8 || at[L_SLOT_TAG] + 4 > at[L_BODY]
        || at[L_SLOT_CRC] < 8 || at[L_SLOT_CRC] + 4 > at[L_BODY]
        || at[L_STRIDE] % 8 || at[L_DATA] % 8 || at[L_STRIDE] < at[L_BODY] + at[L_SLOT_BYTES]
        || at[L_DATA] > len || (len - at[L_DATA]) / at[L_STRIDE] < at[L_N_SLOTS]
        || at[L_ROW_BYTES] < 8 || at[L_ROW_BYTES] % 8 || at[L_TABLE] % 8
        || at[L_ROW_READ_SEQ] % 8 || at[L_ROW_READ_SEQ] + 8 > at[L_ROW_BYTES]
        || at[L_ROW_SLEEPING] % 8 || at[L_ROW_SLEEPING] + 8 > at[L_ROW_BYTES]
        || at[L_TABLE] > len || (len - at[L_TABLE]) / at[L_ROW_BYTES] < n_rows;
    for (int i = L_WRITE_SEQ; i <= L_WRITER_SLEEPING; i++)
        bad = bad || at[i] % 8 || at[i] > len - 8;
    if (row >= 0)
        bad = bad || row < at[L_TABLE] || (row - at[L_TABLE]) % at[L_ROW_BYTES]
            || row > len - at[L_ROW_BYTES];
    if (bad) {
        PyErr_Format(PyExc_ValueError, "the queue layout does not fit its %zd-byte mapping", len);
        return -1;
    }
    if ((row >= 0) != (wait != Py_None) || (row >= 0 && n_post != 1)) {
        PyErr_SetString(PyExc_ValueError, "a reader posts one doorbell and waits on its own; "
                        "the writer posts one per reader and waits on none");
        return -1;
    }
    self->post = PyMem_Calloc(n_post ? n_post : 1, sizeof(sem_t *));
    if (self->post == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->n_post = n_post;
    for (Py_ssize_t r = 0; r < n_post; r++)
        if ((self->post[r] = open_bell(PyTuple_GET_ITEM(post, r))) == NULL)
            goto fail;
    if (wait != Py_None && (self->wait = open_bell(wait)) == NULL)
        goto fail;
    self->row = row;
    Py_INCREF(words);
    self->words = w;
    return 0;
fail:
    close_bells(self);
    return -1;
}

static void
slots_dealloc(SlotsObject *self)
{
    close_bells(self);
    Py_CLEAR(self->words);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef slots_methods[] = {
    {"publish", (PyCFunction)(void (*)(void))slots_publish, METH_FASTCALL,
     "Write message `seq` (tag, body), publish it and wake sleeping readers."},
    {"take", (PyCFunction)slots_take, METH_O,
     "None until message `seq` is in its slot; then (tag, nbytes), or 1 (too large), 2 (CRC)."},
    {"finish", (PyCFunction)slots_finish, METH_O,
     "Consume message `seq` if its slot still holds it; say whether it did."},
    {"sleep", (PyCFunction)(void (*)(void))slots_sleep, METH_FASTCALL,
     "Sleep on this reader's doorbell up to `seconds`; say whether message `seq` arrived."},
    {"release", (PyCFunction)slots_release, METH_NOARGS,
     "Close the doorbells and drop the words; idempotent."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SlotsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmstore._native._atomic.Slots",
    .tp_doc = "A broadcast queue's slots: the hand-off of queue/_layout.py in one call per step.",
    .tp_basicsize = sizeof(SlotsObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)slots_init,
    .tp_dealloc = (destructor)slots_dealloc,
    .tp_methods = slots_methods,
};

static struct PyModuleDef atomic_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "shmstore._native._atomic",
    .m_doc = "Ordered access to aligned 8-byte words of a shared mapping (see _atomic.c).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__atomic(void)
{
    if (PyType_Ready(&WordsType) < 0 || PyType_Ready(&SlotsType) < 0)
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
    Py_INCREF(&SlotsType);
    if (PyModule_AddObject(module, "Slots", (PyObject *)&SlotsType) < 0) {
        Py_DECREF(&SlotsType);
        Py_DECREF(module);
        return NULL;
    }
    PyObject *names = PyTuple_New(L_COUNT);
    if (names == NULL) {
        Py_DECREF(module);
        return NULL;
    }
    for (int i = 0; i < L_COUNT; i++) {
        PyObject *text = PyUnicode_FromString(layout_names[i]);
        if (text == NULL) {
            Py_DECREF(names);
            Py_DECREF(module);
            return NULL;
        }
        PyTuple_SET_ITEM(names, i, text);
    }
    if (PyModule_AddObject(module, "HANDOFF_LAYOUT", names) < 0) {
        Py_DECREF(names);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
