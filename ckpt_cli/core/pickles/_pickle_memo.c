/* A pickle rewritten without the memo stores nothing reads back: the same value, built in far less memory.

   The C unpickler keeps every memoized object alive until the load ends. Picklers memoize every container and
   object they write (a DCP `.metadata` of 200,000 chunks: about three state dicts, tuples and records per chunk)
   though only shared values are ever fetched again, so a large pickle's load peaks at several times the value it
   builds. `lean` drops the stores (PUT, BINPUT, LONG_BINPUT, MEMOIZE) whose index no GET names, numbers the
   ones that remain 0, 1, 2, ... (the unpickler's memo is an array as long as the largest index) and drops FRAME
   hints (optional; their lengths would no longer hold). Nothing else changes: every other opcode is copied byte
   for byte, so the value is the one the original builds, through the same allow list.

   One change on request: an EMPTY_DICT that follows a binary text equal to one of the `replacements` keys, or a
   GET of a store of it (memo stores and FRAMEs may stand between), is replaced by that key's opcodes, which push an object whose __setitem__
   the unpickler then calls for each of the dict's items (a DCP `.metadata`'s storage_data: two records a chunk,
   packed as they come instead of held in a dict of 581,160 entries until the load ends).

   Called only on a pickle the guard's scan (core/_pickle_scan.c, pickle_guard.py) accepted; it still checks every
   bound and answers None, "load the original", for anything it does not handle: text-form memo opcodes (protocol
   0/1), PUT and MEMOIZE mixed, a GET of an index no store made, an opcode or argument past the end. The opcode
   table (kind and argument size of each byte) is pickle_guard's, as for the scan. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* pickle_guard's K_* (the same numbering as _pickle_scan.c). */
enum {
    K_GET1, K_MEMOIZE, K_ATOM, K_TUPLE, K_MARK, K_ATOM_LEN, K_EMPTY, K_GET4, K_PUT1, K_PUT4, K_CALL, K_BUILD, K_FILL_MARK,
    K_FILL, K_TO_MARK, K_ATOM_LINES, K_POP, K_POP_MARK, K_DUP, K_REPLACE, K_SKIP, K_STOP, K_BIGINT, K_PUT_LINE, K_GET_LINE,
    K_INST, K_NONE = 255
};

#define FRAME 0x95
#define BINGET 'h'
#define LONG_BINGET 'j'
#define BINPUT 'q'
#define LONG_BINPUT 'r'

#define EMPTY_DICT '}'
#define SHORT_BINUNICODE 0x8c
#define BINUNICODE 'X'
#define BINUNICODE8 0x8d

#define MAX_KEYS 8

typedef struct {
    const unsigned char *bytes;
    Py_ssize_t len;
} Text;

typedef struct {
    const unsigned char *data, *kinds, *ns;
    Py_ssize_t end;
    int keys; /* the empty dict right after the text key[i] becomes the opcodes replacement[i] */
    Text key[MAX_KEYS], replacement[MAX_KEYS];
} Ops;

/* Little-endian integer of n bytes at pos (the caller checked they are there). */
static int64_t le(const unsigned char *p, int n, int is_signed) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = (v << 8) | p[i];
    if (is_signed && n < 8 && (p[n - 1] & 0x80)) v |= ~(uint64_t)0 << (8 * n);
    return (int64_t)v;
}

/* The position after `lines` newline-ended lines from pos, -1 past the end. */
static Py_ssize_t after_lines(const Ops *o, Py_ssize_t pos, int64_t lines) {
    for (int64_t i = 0; i < lines; i++) {
        if (pos >= o->end) return -1;
        const unsigned char *nl = memchr(o->data + pos, '\n', o->end - pos);
        if (!nl) return -1;
        pos = nl - o->data + 1;
    }
    return pos;
}

/* The position of the opcode after the one at pos, -1 when it is cut off or unknown. */
static Py_ssize_t next_op(const Ops *o, Py_ssize_t pos) {
    unsigned char op = o->data[pos], kind = o->kinds[op];
    int64_t n = o->ns[op];
    pos += 1;
    switch (kind) {
        case K_NONE:
            return -1;
        case K_GET1: case K_GET4: case K_ATOM: case K_PUT1: case K_PUT4: case K_SKIP:
            pos += n;
            break;
        case K_ATOM_LEN: case K_BIGINT: {
            if (pos + n > o->end) return -1;
            int is_signed = (kind == K_ATOM_LEN && op == 0x54) || (kind == K_BIGINT && n == 4);
            int64_t length = le(o->data + pos, (int)n, is_signed);
            if (length < 0 || (uint64_t)length > (uint64_t)(o->end - pos - n)) return -1;
            pos += n + length;
            break;
        }
        case K_ATOM_LINES: case K_GET_LINE:
            return after_lines(o, pos, n);
        case K_PUT_LINE:
            return after_lines(o, pos, 1);
        case K_INST:
            return after_lines(o, pos, 2);
        default: /* no argument bytes: n counts stack items */
            break;
    }
    return pos > o->end ? -1 : pos;
}

/* 1 + which key the opcode at pos (whole: next_op found its end) is a binary text equal to; 0 for none. */
static int is_key(const Ops *o, Py_ssize_t pos) {
    unsigned char op = o->data[pos];
    if (!o->keys || (op != SHORT_BINUNICODE && op != BINUNICODE && op != BINUNICODE8)) return 0;
    int n = (int)o->ns[op];
    int64_t len = le(o->data + pos + 1, n, 0);
    for (int k = 0; k < o->keys; k++) {
        if (len == (int64_t)o->key[k].len && memcmp(o->data + pos + 1 + n, o->key[k].bytes, (size_t)len) == 0) return k + 1;
    }
    return 0;
}

/* Where a key's dict may come: after the key's text, pushed or fetched from the memo, only memo stores and FRAMEs
   stand before its EMPTY_DICT. The stores made of a key's text are remembered (the first few), for the GETs. */
#define MAX_KEY_STORES 64

typedef struct {
    int after_key; /* 1 + the key whose text is on top of the stack, 0 for none */
    int64_t memoized; /* MEMOIZEs so far: the index the next one makes */
    int stores;
    int64_t store_index[MAX_KEY_STORES];
    int store_key[MAX_KEY_STORES];
} KeyTrack;

static int stored_key(const KeyTrack *t, int64_t index) {
    for (int i = 0; i < t->stores; i++)
        if (t->store_index[i] == index) return t->store_key[i];
    return 0;
}

static void store(KeyTrack *t, int64_t index, int key) {
    for (int i = 0; i < t->stores; i++) {
        if (t->store_index[i] == index) { /* a store over an earlier one: it holds this value now */
            t->store_key[i] = key;
            return;
        }
    }
    if (key && t->stores < MAX_KEY_STORES) {
        t->store_index[t->stores] = index;
        t->store_key[t->stores++] = key;
    }
}

/* The state after the opcode at pos (whole: next_op found its end). */
static void track(const Ops *o, KeyTrack *t, Py_ssize_t pos) {
    if (!o->keys) return;
    unsigned char op = o->data[pos], kind = o->kinds[op];
    int64_t n = o->ns[op];
    if (kind == K_MEMOIZE || kind == K_PUT1 || kind == K_PUT4) {
        store(t, kind == K_MEMOIZE ? t->memoized : le(o->data + pos + 1, (int)n, 0), t->after_key);
        if (kind == K_MEMOIZE) t->memoized++;
    } else if (kind == K_GET1 || kind == K_GET4) {
        t->after_key = stored_key(t, le(o->data + pos + 1, (int)n, 0));
    } else if (op != FRAME) {
        t->after_key = is_key(o, pos);
    }
}

/* First pass: which memo indices a GET names (bit per index), and whether the pickle is one the rewrite handles. */
typedef struct {
    uint64_t *wanted; /* bitmap over [0, limit) */
    int64_t limit;
    int64_t memoizes, puts;
    int64_t frames; /* dropped whatever else happens */
    int64_t replaced; /* keys' dicts made by their replacements */
    int early_get; /* a GET of an index past the MEMOIZEs so far (with MEMOIZE, a value not stored yet) */
    int64_t growth; /* bytes the replacements add */
} Uses;

static int mark(Uses *u, int64_t index) {
    if (index < 0 || index >= u->limit) return -1;
    u->wanted[index >> 6] |= (uint64_t)1 << (index & 63);
    return 0;
}

static int is_wanted(const Uses *u, int64_t index) {
    return index >= 0 && index < u->limit && (u->wanted[index >> 6] >> (index & 63)) & 1;
}

static int survey(const Ops *o, Uses *u) {
    Py_ssize_t pos = 0;
    KeyTrack t = {0};
    while (pos < o->end) {
        unsigned char kind = o->kinds[o->data[pos]];
        int64_t n = o->ns[o->data[pos]];
        if (kind == K_PUT_LINE || kind == K_GET_LINE) return -1;
        Py_ssize_t next = next_op(o, pos);
        if (next < 0) return -1;
        if (o->data[pos] == FRAME) {
            /* a frame longer than what follows is the unpickler's "truncated" error: kept, by loading the original */
            if ((uint64_t)le(o->data + pos + 1, 8, 0) > (uint64_t)(o->end - next)) return -1;
            u->frames++;
        }
        if (kind == K_MEMOIZE) u->memoizes++;
        if (kind == K_PUT1 || kind == K_PUT4) u->puts++;
        if (kind == K_GET1 || kind == K_GET4) {
            /* an index past every store so far is one no store made (the scan refused it): not handled */
            int64_t index = le(o->data + pos + 1, (int)n, 0);
            if (mark(u, index)) return -1;
            if (index >= u->memoizes) u->early_get = 1;
        }
        if (t.after_key && o->data[pos] == EMPTY_DICT) {
            u->replaced++;
            u->growth += o->replacement[t.after_key - 1].len - 1;
        }
        track(o, &t, pos);
        if (kind == K_STOP) return 0;
        pos = next;
    }
    return -1;
}

/* The new index of a kept store: how many wanted indices lie below it (a prefix count per 64 indices). */
static uint32_t rank_of(const Uses *u, const uint32_t *prefix, int64_t index) {
    uint64_t below = u->wanted[index >> 6] & (((uint64_t)1 << (index & 63)) - 1);
    return prefix[index >> 6] + (uint32_t)__builtin_popcountll(below);
}

static Py_ssize_t emit_index(unsigned char *out, Py_ssize_t w, unsigned char short_op, unsigned char long_op, uint32_t index) {
    if (index < 256) {
        out[w++] = short_op;
        out[w++] = (unsigned char)index;
    } else {
        out[w++] = long_op;
        for (int i = 0; i < 4; i++) out[w++] = (unsigned char)(index >> (8 * i));
    }
    return w;
}

/* Second pass: copy every opcode except the unread stores and FRAMEs; the kept stores and their GETs numbered
   0, 1, 2, ... in the order of their original indices (never larger, so never a longer opcode); the key's empty
   dicts replaced. */
static Py_ssize_t rewrite(const Ops *o, const Uses *u, const uint32_t *prefix, unsigned char *out) {
    Py_ssize_t pos = 0, w = 0;
    int64_t memoized = 0;
    KeyTrack t = {0};
    while (pos < o->end) {
        unsigned char op = o->data[pos], kind = o->kinds[op];
        int64_t n = o->ns[op];
        Py_ssize_t next = next_op(o, pos);
        if (next < 0) return -1;
        int after_key = t.after_key;
        track(o, &t, pos); /* before the write: in place, it may overwrite this opcode's bytes */
        if (op == FRAME) {
            /* dropped */
        } else if (after_key && op == EMPTY_DICT) {
            const Text *r = &o->replacement[after_key - 1];
            memcpy(out + w, r->bytes, (size_t)r->len); /* in place, never past the next opcode: see lean_in_place */
            w += r->len;
        } else if (kind == K_MEMOIZE) {
            if (is_wanted(u, memoized)) out[w++] = op; /* numbered by count: its rank */
            memoized++;
        } else if (kind == K_PUT1 || kind == K_PUT4) {
            int64_t index = le(o->data + pos + 1, (int)n, 0);
            if (is_wanted(u, index)) w = emit_index(out, w, BINPUT, LONG_BINPUT, rank_of(u, prefix, index));
        } else if (kind == K_GET1 || kind == K_GET4) {
            int64_t index = le(o->data + pos + 1, (int)n, 0);
            if (u->memoizes && index >= memoized) return -1; /* fetched before it was stored */
            w = emit_index(out, w, BINGET, LONG_BINGET, rank_of(u, prefix, index));
        } else {
            memmove(out + w, o->data + pos, next - pos); /* in place, the two may overlap */
            w += next - pos;
        }
        if (kind == K_STOP) return w;
        pos = next;
    }
    return -1;
}

/* The replacements dict's bytes keys and opcodes into o (the dict, holding them, outlives the call). */
static int read_replacements(PyObject *replacements, Ops *o) {
    if (!replacements) return 0;
    if (PyDict_GET_SIZE(replacements) > MAX_KEYS) {
        PyErr_SetString(PyExc_ValueError, "too many replacements");
        return -1;
    }
    PyObject *key, *value;
    Py_ssize_t i = 0;
    while (PyDict_Next(replacements, &i, &key, &value)) {
        if (!PyBytes_Check(key) || !PyBytes_Check(value) || !PyBytes_GET_SIZE(key) || !PyBytes_GET_SIZE(value)) {
            PyErr_SetString(PyExc_ValueError, "a replacement is non-empty bytes for non-empty bytes");
            return -1;
        }
        o->key[o->keys] = (Text){(const unsigned char *)PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key)};
        o->replacement[o->keys] = (Text){(const unsigned char *)PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value)};
        o->keys++;
    }
    return 0;
}

/* Survey the pickle in `o`: 1 to rewrite it (`u` and `prefix` made: the caller frees them), 0 to leave it as it is
   (something it does not handle, or nothing to drop), -1 with an error set. */
static int plan(Ops *o, Uses *u, uint32_t **prefix) {
    /* Indices a store can make: at most one per opcode, so fewer than the pickle's bytes. */
    u->limit = o->end;
    Py_ssize_t words = (Py_ssize_t)(u->limit >> 6) + 1;
    u->wanted = calloc((size_t)words, sizeof(uint64_t));
    if (!u->wanted) {
        PyErr_NoMemory();
        return -1;
    }
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = survey(o, u) == 0 && !(u->memoizes && u->puts) && !(u->memoizes && u->early_get);
    Py_END_ALLOW_THREADS
    if (!ok) return 0;
    *prefix = malloc((size_t)words * sizeof(uint32_t));
    if (!*prefix) {
        PyErr_NoMemory();
        return -1;
    }
    uint32_t wanted = 0; /* indices a GET names: before word i, prefix[i] of them */
    for (Py_ssize_t i = 0; i < words; i++) {
        (*prefix)[i] = wanted;
        wanted += (uint32_t)__builtin_popcountll(u->wanted[i]);
    }
    /* every store is read back, no FRAME, no replacement: nothing to drop */
    return u->frames || u->replaced || wanted < u->memoizes + u->puts;
}

static int parse_tables(Py_buffer *kinds, Py_buffer *ns) {
    if (kinds->len == 256 && ns->len == 256) return 0;
    PyErr_SetString(PyExc_ValueError, "the opcode table has 256 entries");
    return -1;
}

static PyObject *lean(PyObject *self, PyObject *args) {
    Py_buffer data, kinds, ns;
    PyObject *replacements = NULL;
    if (!PyArg_ParseTuple(args, "y*y*y*|O!", &data, &kinds, &ns, &PyDict_Type, &replacements)) return NULL;
    PyObject *result = NULL;
    Uses u = {0};
    uint32_t *prefix = NULL;
    Ops o = {data.buf, kinds.buf, ns.buf, data.len, 0};
    if (parse_tables(&kinds, &ns) || read_replacements(replacements, &o)) goto done;
    int planned = plan(&o, &u, &prefix);
    if (planned <= 0) {
        result = planned < 0 ? NULL : Py_NewRef(Py_None);
        goto done;
    }
    /* Stores and FRAMEs only go and a new index is at most the original; each replaced dict grows by its
       opcodes less its one byte. */
    if (u.growth > PY_SSIZE_T_MAX - data.len) {
        PyErr_NoMemory();
        goto done;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, data.len + (Py_ssize_t)u.growth);
    if (!out) goto done;
    Py_ssize_t written;
    Py_BEGIN_ALLOW_THREADS
    written = rewrite(&o, &u, prefix, (unsigned char *)PyBytes_AS_STRING(out));
    Py_END_ALLOW_THREADS
    if (written < 0 || (written == data.len && !u.replaced)) { /* nothing dropped: the original is as lean */
        Py_DECREF(out);
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (_PyBytes_Resize(&out, written) == 0) result = out;
done:
    free(u.wanted);
    free(prefix);
    PyBuffer_Release(&data);
    PyBuffer_Release(&kinds);
    PyBuffer_Release(&ns);
    return result;
}

/* The same rewrite, over the pickle's own bytes: `buffer` holds `headroom` free bytes, then the pickle; the rewrite
   goes to the buffer's start, so that a large pickle is never held twice. Writing at w while reading at pos is safe
   while w <= pos + headroom before each opcode: dropped stores and renumbered GETs only shrink, and each replaced
   dict adds its opcodes less one byte, at most `growth` <= headroom in all, so no write reaches an opcode not yet
   read. The survey (which changes nothing) has found every condition the rewrite could fail on, so a pickle it
   starts on is never left half rewritten. Answers the new length, or None: the buffer unchanged (not handled,
   nothing to drop, or more growth than headroom). */
static PyObject *lean_in_place(PyObject *self, PyObject *args) {
    Py_buffer buffer, kinds, ns;
    Py_ssize_t headroom;
    PyObject *replacements = NULL;
    if (!PyArg_ParseTuple(args, "w*y*y*n|O!", &buffer, &kinds, &ns, &headroom, &PyDict_Type, &replacements)) return NULL;
    PyObject *result = NULL;
    Uses u = {0};
    uint32_t *prefix = NULL;
    if (headroom < 0 || headroom > buffer.len) {
        PyErr_SetString(PyExc_ValueError, "headroom outside the buffer");
        goto done;
    }
    unsigned char *start = buffer.buf;
    Ops o = {start + headroom, kinds.buf, ns.buf, buffer.len - headroom, 0};
    if (parse_tables(&kinds, &ns) || read_replacements(replacements, &o)) goto done;
    int planned = plan(&o, &u, &prefix);
    if (planned <= 0 || u.growth > headroom) {
        result = planned < 0 ? NULL : Py_NewRef(Py_None);
        goto done;
    }
    Py_ssize_t written;
    Py_BEGIN_ALLOW_THREADS
    written = rewrite(&o, &u, prefix, start);
    Py_END_ALLOW_THREADS
    if (written < 0) { /* the survey rules this out; never load what is left */
        PyErr_SetString(PyExc_RuntimeError, "the rewrite in place stopped part way");
        goto done;
    }
    result = PyLong_FromSsize_t(written);
done:
    free(u.wanted);
    free(prefix);
    PyBuffer_Release(&buffer);
    PyBuffer_Release(&kinds);
    PyBuffer_Release(&ns);
    return result;
}

static PyMethodDef methods[] = {
    {"lean_in_place", lean_in_place, METH_VARARGS,
     "lean_in_place(buffer, kinds, ns, headroom[, replacements]) -> the rewrite's length at the buffer's start, or None"},
    {"lean", lean, METH_VARARGS, "lean(data, kinds, ns[, replacements]) -> the pickle without unread memo stores (the empty dict after a key text made by its opcodes), or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pickle_memo", NULL, -1, methods};

PyMODINIT_FUNC PyInit__pickle_memo(void) { return PyModule_Create(&module); }
