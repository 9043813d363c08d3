/* kvindex.ingest._drain: the messages already queued on a ZeroMQ socket, read in one call.
 *
 * The twin of ``kvindex.ingest.transport.queued_parts`` called in a loop: the same parts, in the
 * same order, as ``list[bytes]`` per message. Each part costs one zmq_msg_recv here, where pyzmq
 * makes a Frame object (or asks RCVMORE) per part: about 1 µs a part.
 *
 * Invariants:
 * - No libzmq header and no link to libzmq: ``Library`` is made from the addresses of six
 *   libzmq functions (``kvindex.ingest.libzmq`` takes them from the very libzmq pyzmq's sockets
 *   belong to, and proves it on a socket first). zmq_msg_t is 64 bytes (its public ABI since
 *   libzmq 4.1), kept aligned.
 * - ``drain(handle, limit)`` never blocks (ZMQ_DONTWAIT) and holds the GIL throughout: it only
 *   copies what libzmq already queued. It stops at ``limit`` messages, or when nothing is queued.
 *   A message's parts are read to its last (libzmq queues a message whole). Any error other than
 *   "nothing queued" ends the drain, with what it read so far; the caller's next (awaited) read
 *   meets that error and reports it as pyzmq does.
 * - ``drain_frames`` is ``transport.burst_of(drain(...))`` (its Python twin, the reference) in one
 *   call: the same messages, counted the same. It recognises only the common message (three parts,
 *   an 8-byte seq that is not the end marker, a topic of at most ``max_topic_bytes`` printable ASCII
 *   bytes, which decodes as UTF-8 to a str without control characters) and makes its ``Frame``
 *   itself; every other message's parts go to ``parse`` (``transport.parse_message``), which alone
 *   says what is malformed. A topic repeated in the burst is one str object.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define KX_DONTWAIT 1 /* ZMQ_DONTWAIT */

typedef struct { _Alignas(8) unsigned char bytes[64]; } kx_msg; /* zmq_msg_t */

typedef int (*msg_init_fn)(kx_msg *);
typedef int (*msg_recv_fn)(kx_msg *, void *, int);
typedef int (*msg_close_fn)(kx_msg *);
typedef void *(*msg_data_fn)(kx_msg *);
typedef size_t (*msg_size_fn)(const kx_msg *);
typedef int (*msg_more_fn)(const kx_msg *);

typedef struct {
    PyObject_HEAD
    msg_init_fn init;
    msg_recv_fn recv;
    msg_close_fn close;
    msg_data_fn data;
    msg_size_fn size;
    msg_more_fn more;
} Library;

static int address(PyObject *seq, Py_ssize_t i, void **out) {
    PyObject *item = PyTuple_GET_ITEM(seq, i);
    void *p = PyLong_AsVoidPtr(item);
    if (p == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a libzmq function address is 0");
        return -1;
    }
    *out = p;
    return 0;
}

static int Library_init(Library *self, PyObject *args, PyObject *kwds) {
    PyObject *fns;
    if (!PyArg_ParseTuple(args, "O!", &PyTuple_Type, &fns)) return -1;
    if (PyTuple_GET_SIZE(fns) != 6) {
        PyErr_SetString(PyExc_ValueError, "Library((zmq_msg_init, zmq_msg_recv, zmq_msg_close, zmq_msg_data, "
                                          "zmq_msg_size, zmq_msg_more)): six addresses");
        return -1;
    }
    void *p[6];
    for (Py_ssize_t i = 0; i < 6; i++)
        if (address(fns, i, &p[i]) < 0) return -1;
    self->init = (msg_init_fn)p[0];
    self->recv = (msg_recv_fn)p[1];
    self->close = (msg_close_fn)p[2];
    self->data = (msg_data_fn)p[3];
    self->size = (msg_size_fn)p[4];
    self->more = (msg_more_fn)p[5];
    return 0;
}

/* The next part into *part (a new bytes); 1 read, 0 nothing queued or an error (stop), -1 Python error. */
static int next_part(Library *lib, void *sock, PyObject **part, int *more) {
    kx_msg msg;
    lib->init(&msg);
    if (lib->recv(&msg, sock, KX_DONTWAIT) < 0) {
        lib->close(&msg);
        return 0;
    }
    *part = PyBytes_FromStringAndSize((const char *)lib->data(&msg), (Py_ssize_t)lib->size(&msg));
    *more = lib->more(&msg);
    lib->close(&msg);
    return *part == NULL ? -1 : 1;
}

/* One queued message's parts (a new list), NULL with no error set when nothing is queued. */
static PyObject *next_message(Library *lib, void *sock) {
    PyObject *part, *parts = NULL;
    int more = 1, got;
    while (more && (got = next_part(lib, sock, &part, &more)) != 0) {
        if (got < 0 || (parts == NULL && (parts = PyList_New(0)) == NULL)) {
            if (got > 0) Py_DECREF(part);
            Py_XDECREF(parts);
            return NULL;
        }
        int failed = PyList_Append(parts, part);
        Py_DECREF(part);
        if (failed) {
            Py_DECREF(parts);
            return NULL;
        }
    }
    return parts;
}

PyDoc_STRVAR(drain_doc,
"drain(handle, limit) -> list[list[bytes]]\n\n"
"Up to ``limit`` messages already queued on the socket at ``handle`` (pyzmq's ``Socket.underlying``),\n"
"each as its parts; an empty list when none is queued. Never blocks.");

static PyObject *Library_drain(Library *self, PyObject *args) {
    PyObject *handle;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "On", &handle, &limit)) return NULL;
    void *sock = PyLong_AsVoidPtr(handle);
    if (sock == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "socket handle is 0");
        return NULL;
    }
    PyObject *out = PyList_New(0);
    for (Py_ssize_t n = 0; out != NULL && n < limit; n++) {
        PyObject *parts = next_message(self, sock);
        if (parts == NULL) {
            if (PyErr_Occurred()) Py_CLEAR(out);
            break;
        }
        if (PyList_Append(out, parts) < 0) Py_CLEAR(out);
        Py_DECREF(parts);
    }
    return out;
}

/* Whether the message is the common one drain_frames makes its Frame of (see the invariants). */
static int common_message(kx_msg *msgs, Library *lib, Py_ssize_t max_topic) {
    size_t tlen = lib->size(&msgs[0]);
    if (lib->size(&msgs[1]) != 8 || tlen > (size_t)max_topic) return 0;
    const unsigned char *seq = (const unsigned char *)lib->data(&msgs[1]);
    int ones = 1;
    for (int i = 0; i < 8; i++) ones &= seq[i] == 0xff;
    if (ones) return 0;
    const unsigned char *t = (const unsigned char *)lib->data(&msgs[0]);
    for (size_t i = 0; i < tlen; i++)
        if (t[i] < 0x20 || t[i] > 0x7e) return 0;
    return 1;
}

typedef struct {
    PyObject *frame, *parse, *topic; /* topic: the last topic made (a new reference), or NULL */
    Py_ssize_t max_topic;
} Parsing;

/* The common message's Frame(topic, seq, payload), a new reference (NULL: an error is set). */
static PyObject *make_frame(Library *lib, kx_msg *msgs, Parsing *p) {
    const char *t = (const char *)lib->data(&msgs[0]);
    Py_ssize_t tlen = (Py_ssize_t)lib->size(&msgs[0]);
    if (p->topic == NULL || PyUnicode_GET_LENGTH(p->topic) != tlen || memcmp(PyUnicode_DATA(p->topic), t, tlen)) {
        PyObject *topic = PyUnicode_DecodeASCII(t, tlen, "strict");
        if (topic == NULL) return NULL;
        Py_XSETREF(p->topic, topic);
    }
    const unsigned char *s = (const unsigned char *)lib->data(&msgs[1]);
    unsigned long long seq = 0;
    for (int i = 0; i < 8; i++) seq = (seq << 8) | s[i];
    PyObject *args[3] = {p->topic, PyLong_FromUnsignedLongLong(seq),
                         PyBytes_FromStringAndSize((const char *)lib->data(&msgs[2]), (Py_ssize_t)lib->size(&msgs[2]))};
    PyObject *frame = NULL;
    if (args[1] != NULL && args[2] != NULL) frame = PyObject_Vectorcall(p->frame, args, 3, NULL);
    Py_XDECREF(args[1]);
    Py_XDECREF(args[2]);
    return frame;
}

/* The parts read so far (n open messages) as bytes, then the rest of the message's, parsed by
 * ``parse``: a new reference (NULL: an error is set). The open messages are the caller's to close. */
static PyObject *parse_parts(Library *lib, void *sock, kx_msg *msgs, int n, int more, Parsing *p,
                             Py_ssize_t *nbytes, Py_ssize_t *last) {
    PyObject *parts = PyList_New(0);
    if (parts == NULL) return NULL;
    for (int i = 0; i < n; i++) {
        PyObject *b = PyBytes_FromStringAndSize((const char *)lib->data(&msgs[i]), (Py_ssize_t)lib->size(&msgs[i]));
        if (b == NULL || PyList_Append(parts, b) < 0) {
            Py_XDECREF(b);
            Py_DECREF(parts);
            return NULL;
        }
        Py_DECREF(b);
    }
    PyObject *part;
    int got;
    while (more && (got = next_part(lib, sock, &part, &more)) != 0) {
        if (got < 0 || PyList_Append(parts, part) < 0) {
            if (got > 0) Py_DECREF(part);
            Py_DECREF(parts);
            return NULL;
        }
        Py_DECREF(part);
    }
    Py_ssize_t count = PyList_GET_SIZE(parts);
    for (Py_ssize_t i = 0; i < count; i++) *nbytes += PyBytes_GET_SIZE(PyList_GET_ITEM(parts, i));
    *last += PyBytes_GET_SIZE(PyList_GET_ITEM(parts, count - 1));
    PyObject *parsed = PyObject_CallOneArg(p->parse, parts);
    Py_DECREF(parts);
    return parsed;
}

/* The next queued message as drain_frames hands it (a new reference); NULL with no error set when
 * nothing is queued. */
static PyObject *next_frame(Library *lib, void *sock, Parsing *p, Py_ssize_t *nbytes, Py_ssize_t *last) {
    kx_msg msgs[3];
    int n = 0, more = 1;
    for (; more && n < 3; n++) {
        lib->init(&msgs[n]);
        if (lib->recv(&msgs[n], sock, KX_DONTWAIT) < 0) { /* nothing queued, or an error: stop there */
            lib->close(&msgs[n]);
            more = 0;
            break;
        }
        more = lib->more(&msgs[n]);
    }
    PyObject *out = NULL;
    if (n == 3 && !more && common_message(msgs, lib, p->max_topic)) {
        for (int i = 0; i < 3; i++) *nbytes += (Py_ssize_t)lib->size(&msgs[i]);
        *last += (Py_ssize_t)lib->size(&msgs[2]);
        out = make_frame(lib, msgs, p);
    } else if (n > 0) {
        out = parse_parts(lib, sock, msgs, n, more, p, nbytes, last);
    }
    for (int i = 0; i < n; i++) lib->close(&msgs[i]);
    return out;
}

PyDoc_STRVAR(drain_frames_doc,
"drain_frames(handle, limit, frame, parse, max_topic_bytes, overhead) -> (messages, nbytes, payload_bytes)\n\n"
"``transport.burst_of(drain(handle, limit))`` in one call: up to ``limit`` queued messages, each a\n"
"``frame`` made here (the common message) or what ``parse`` makes of its parts; their parts' bytes\n"
"plus ``overhead`` a message; their last parts' bytes. Never blocks.");

static PyObject *Library_drain_frames(Library *self, PyObject *args) {
    PyObject *handle;
    Py_ssize_t limit, overhead;
    Parsing p = {NULL, NULL, NULL, 0};
    if (!PyArg_ParseTuple(args, "OnOOnn", &handle, &limit, &p.frame, &p.parse, &p.max_topic, &overhead)) return NULL;
    void *sock = PyLong_AsVoidPtr(handle);
    if (sock == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "socket handle is 0");
        return NULL;
    }
    Py_ssize_t nbytes = 0, last = 0;
    PyObject *out = PyList_New(0);
    for (Py_ssize_t n = 0; out != NULL && n < limit; n++) {
        PyObject *msg = next_frame(self, sock, &p, &nbytes, &last);
        if (msg == NULL) {
            if (PyErr_Occurred()) Py_CLEAR(out);
            break;
        }
        if (PyList_Append(out, msg) < 0) Py_CLEAR(out);
        Py_DECREF(msg);
    }
    Py_XDECREF(p.topic);
    if (out == NULL) return NULL;
    nbytes += overhead * PyList_GET_SIZE(out);
    return Py_BuildValue("(Nnn)", out, nbytes, last);
}

static PyMethodDef Library_methods[] = {
    {"drain", (PyCFunction)Library_drain, METH_VARARGS, drain_doc},
    {"drain_frames", (PyCFunction)Library_drain_frames, METH_VARARGS, drain_frames_doc},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LibraryType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvindex.ingest._drain.Library",
    .tp_basicsize = sizeof(Library),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Library((zmq_msg_init, zmq_msg_recv, zmq_msg_close, zmq_msg_data, zmq_msg_size, zmq_msg_more)): "
              "libzmq reached through these function addresses.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Library_init,
    .tp_methods = Library_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvindex.ingest._drain",
    "A ZeroMQ socket's queued messages read in one call (kvindex.ingest.transport.queued_parts is the twin).",
    -1, NULL,
};

PyMODINIT_FUNC PyInit__drain(void) {
    if (PyType_Ready(&LibraryType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&LibraryType);
    if (PyModule_AddObject(m, "Library", (PyObject *)&LibraryType) < 0) {
        Py_DECREF(&LibraryType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
