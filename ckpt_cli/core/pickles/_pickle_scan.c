/* The opcode scan of core/pickle_guard.py (_Scan._run), in C: the same walk, the same bounds, the same verdicts.

   A DCP `.metadata` of a wide checkpoint holds millions of opcodes (82 MB at 64 ranks x 2,000 parameters: ~14M);
   the Python loop costs ~2 us each, this one a few ns. pickle_guard.py is the reference: every branch below is
   the branch of the same name there, in the same order, with Python's slicing and exceptions mirrored (an
   IndexError, KeyError or ValueError there is MALFORMED here). The opcode table (kind and argument size of each
   byte) is built in Python and passed in, so both walks read one table. Values are (depth, size) pairs: the
   Python scan packs them as depth << 62 | size. tests/test_hostile_pickles.py runs both on every pickle. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Opcode kinds: pickle_guard's K_* in the same order. */
enum {
    K_GET1, K_MEMOIZE, K_ATOM, K_TUPLE, K_MARK, K_ATOM_LEN, K_EMPTY, K_GET4, K_PUT1, K_PUT4, K_CALL, K_BUILD, K_FILL_MARK,
    K_FILL, K_TO_MARK, K_ATOM_LINES, K_POP, K_POP_MARK, K_DUP, K_REPLACE, K_SKIP, K_STOP, K_BIGINT, K_PUT_LINE, K_GET_LINE,
    K_INST, K_NONE = 255
};

/* Verdicts: 0 exact, 1 inexact; refusals are negative (pickle_guard.SCAN_REFUSALS maps them to its messages). */
enum {
    R_MALFORMED = -1, R_DEPTH = -2, R_MEMO_OF_NOTHING = -3, R_UNDERFLOW = -4, R_NEGATIVE_LENGTH = -5, R_MEMO_RANGE = -6,
    R_HASH = -7, R_EXPANSION = -8, R_TRUNCATED = -9, R_NO_STOP = -10, R_NO_MEMORY = -11
};

#define CAP ((uint64_t)1 << 30)

typedef struct {
    uint32_t size; /* at most CAP */
    uint32_t depth;
} Val;

/* The memo: a dense array by index. PUT may name any index up to the opcode count (larger ones are refused),
   so the array is at most 8 bytes per opcode, and real pickles number their stores 0, 1, 2, ... (a hash table
   of the millions of stores in a wide `.metadata` took 24 bytes each at half load: 330 MB at 200,000 chunks). */
typedef struct {
    Val value;
} Slot;

#define PRESENT ((uint32_t)1 << 31) /* in value.depth: depths stay below max_depth, far under this bit */
#define FETCHED ((uint32_t)1 << 30)
#define DEPTH_BITS (FETCHED - 1)

typedef struct {
    const unsigned char *data;
    Py_ssize_t end;
    const unsigned char *kinds, *ns;
    long max_depth;
    int64_t hash_left;
    Val *stack;
    Py_ssize_t sp, stack_cap;
    Py_ssize_t *memo_at; /* stack position -> memo index, -1: none (entries outlive pops, as the dict's do) */
    Py_ssize_t *marks;
    Py_ssize_t nmarks, marks_cap;
    Slot *memo;
    Py_ssize_t memo_cap, memo_count;
    int inexact;
} Scan;

static const Val ATOM = {1, 0};
static const Val EMPTY_C = {1, 1};

static int grow_stack(Scan *s) {
    if (s->sp < s->stack_cap) return 0;
    Py_ssize_t cap = s->stack_cap ? s->stack_cap * 2 : 256;
    Val *st = realloc(s->stack, cap * sizeof(Val));
    if (!st) return R_NO_MEMORY;
    s->stack = st;
    Py_ssize_t *at = realloc(s->memo_at, cap * sizeof(Py_ssize_t));
    if (!at) return R_NO_MEMORY;
    for (Py_ssize_t i = s->stack_cap; i < cap; i++) at[i] = -1;
    s->memo_at = at;
    s->stack_cap = cap;
    return 0;
}

static int push(Scan *s, Val v) {
    int r = grow_stack(s);
    if (r) return r;
    s->stack[s->sp++] = v;
    return 0;
}

static Slot *memo_find(Scan *s, int64_t index) {
    if (index < 0 || index >= s->memo_cap || !(s->memo[index].value.depth & PRESENT)) return NULL;
    return &s->memo[index];
}

static Val slot_value(const Slot *slot) {
    Val v = slot->value;
    v.depth &= DEPTH_BITS;
    return v;
}

/* A new value for a slot, its PRESENT and FETCHED flags kept. */
static void slot_store(Slot *slot, Val v) {
    slot->value.size = v.size;
    slot->value.depth = v.depth | (slot->value.depth & (PRESENT | FETCHED));
}

static int memo_set(Scan *s, int64_t index, Val v) {
    if (index >= s->memo_cap) {
        Py_ssize_t cap = s->memo_cap ? s->memo_cap : 1024;
        while (cap <= index) cap *= 2;
        Slot *table = realloc(s->memo, cap * sizeof(Slot));
        if (!table) return R_NO_MEMORY;
        memset(table + s->memo_cap, 0, (cap - s->memo_cap) * sizeof(Slot));
        s->memo = table;
        s->memo_cap = cap;
    }
    Slot *slot = &s->memo[index];
    if (!(slot->value.depth & PRESENT)) {
        slot->value.depth = PRESENT; /* a new entry: not fetched yet */
        s->memo_count++;
    }
    slot_store(slot, v);
    return 0;
}

static Py_ssize_t floor_of(Scan *s) { return s->nmarks ? s->marks[s->nmarks - 1] : 0; }

/* _container: a new container holding items [from, from + count) of the stack. */
static int container(Scan *s, Py_ssize_t from, Py_ssize_t count, Val *out) {
    if (count <= 0) {
        *out = EMPTY_C;
        return 0;
    }
    uint32_t depth = 0;
    uint64_t sum = 0;
    for (Py_ssize_t i = from; i < from + count; i++) {
        if (s->stack[i].depth > depth) depth = s->stack[i].depth;
        sum += s->stack[i].size;
    }
    depth += 1;
    if ((long)depth > s->max_depth) return R_DEPTH;
    out->depth = depth;
    out->size = (uint32_t)(1 + sum < CAP ? 1 + sum : CAP);
    return 0;
}

/* _hash: spend the hash budget on items [from, from + count) taken every `step`. */
static int hash_keys(Scan *s, Py_ssize_t from, Py_ssize_t count, Py_ssize_t step) {
    uint64_t sum = 0;
    Py_ssize_t keys = 0;
    for (Py_ssize_t i = from; i < from + count; i += step) {
        sum += s->stack[i].size;
        keys++;
    }
    s->hash_left -= (int64_t)sum - (int64_t)keys;
    return s->hash_left < 0 ? R_HASH : 0;
}

/* _fill: put items [from, sp) into the container below them, keeping its memo entry up to date. */
static int fill(Scan *s, Py_ssize_t from) {
    Val added;
    int r = container(s, from, s->sp - from, &added);
    if (r) return r;
    s->sp = from;
    Val old = s->stack[s->sp - 1];
    Val updated;
    updated.depth = old.depth > added.depth ? old.depth : added.depth;
    uint64_t size = (uint64_t)old.size + added.size - 1;
    updated.size = (uint32_t)(size < CAP ? size : CAP);
    s->stack[s->sp - 1] = updated;
    Py_ssize_t index = s->memo_at[s->sp - 1];
    Slot *slot = index >= 0 ? memo_find(s, index) : NULL;
    if (slot) {
        Val held = slot_value(slot);
        if (held.depth == old.depth && held.size == old.size) {
            slot_store(slot, updated);
            s->inexact = s->inexact || (slot->value.depth & FETCHED);
        }
    }
    return 0;
}

/* int.from_bytes(data[pos:pos + n], "little", signed=...): the bytes there are, fewer at the end. */
static int64_t from_bytes(Scan *s, Py_ssize_t pos, int n, int is_signed) {
    Py_ssize_t avail = s->end - pos;
    int k = avail < n ? (int)(avail < 0 ? 0 : avail) : n;
    uint64_t v = 0;
    for (int i = k - 1; i >= 0; i--) v = (v << 8) | s->data[pos + i];
    if (is_signed && k > 0 && k < 8 && (s->data[pos + k - 1] & 0x80)) v |= ~(uint64_t)0 << (8 * k);
    if (!is_signed && v > (uint64_t)INT64_MAX) return INT64_MAX; /* past any end: the same verdict, truncated */
    return (int64_t)v;
}

/* data.index(b"\n", pos), -1 when there is none (ValueError in Python). */
static Py_ssize_t newline_at(Scan *s, Py_ssize_t pos) {
    if (pos >= s->end) return -1;
    const unsigned char *p = memchr(s->data + pos, '\n', s->end - pos);
    return p ? p - s->data : -1;
}

/* int(digits) if digits.isdigit() else -1, with values past `limit` reported as limit + 1 (never a valid index). */
static int64_t line_index(Scan *s, Py_ssize_t from, Py_ssize_t to, int64_t limit) {
    if (to <= from) return -1;
    int64_t v = 0;
    for (Py_ssize_t i = from; i < to; i++) {
        unsigned char c = s->data[i];
        if (c < '0' || c > '9') return -1;
        if (v <= limit) v = v * 10 + (c - '0');
    }
    return v <= limit ? v : limit + 1;
}

static int get_index(Scan *s, int64_t index) {
    Slot *slot = index >= 0 ? memo_find(s, index) : NULL;
    if (!slot) return R_MALFORMED; /* KeyError */
    Val v = slot_value(slot);
    if (v.depth >= 1) {
        slot->value.depth |= FETCHED;
        int r = grow_stack(s);
        if (r) return r;
        s->memo_at[s->sp] = (Py_ssize_t)index;
    }
    return push(s, v);
}

static int run(Scan *s, int64_t tree_base, int64_t expansion) {
    const unsigned char *data = s->data;
    Py_ssize_t pos = 0, end = s->end;
    int64_t ops = 0;
    int r = 0;
    while (pos < end) {
        unsigned char kind = s->kinds[data[pos]];
        int64_t n = s->ns[data[pos]];
        if (kind == K_NONE) return R_MALFORMED; /* TypeError: None is not a (kind, n) pair */
        pos += 1;
        ops += 1;
        Py_ssize_t fl = floor_of(s);
        switch (kind) {
            case K_GET1:
            case K_GET4: {
                if (n == 1 && pos >= end) return R_MALFORMED;
                int64_t index = n == 1 ? data[pos] : from_bytes(s, pos, 4, 0);
                pos += n;
                r = get_index(s, index);
                break;
            }
            case K_MEMOIZE:
                if (s->sp <= fl) return R_MEMO_OF_NOTHING;
                s->memo_at[s->sp - 1] = s->memo_count;
                r = memo_set(s, s->memo_count, s->stack[s->sp - 1]);
                break;
            case K_ATOM:
                pos += n;
                r = push(s, ATOM);
                break;
            case K_TUPLE:
            case K_CALL: {
                if (s->sp - n < fl) return R_UNDERFLOW;
                Val v;
                r = container(s, s->sp - n, n, &v);
                if (r) return r;
                s->sp -= n;
                r = push(s, v);
                break;
            }
            case K_MARK:
                if (s->nmarks == s->marks_cap) {
                    Py_ssize_t cap = s->marks_cap ? s->marks_cap * 2 : 64;
                    Py_ssize_t *m = realloc(s->marks, cap * sizeof(Py_ssize_t));
                    if (!m) return R_NO_MEMORY;
                    s->marks = m;
                    s->marks_cap = cap;
                }
                s->marks[s->nmarks++] = s->sp;
                break;
            case K_ATOM_LEN: {
                if (n == 1 && pos >= end) return R_MALFORMED;
                int64_t length = n == 1 ? data[pos] : from_bytes(s, pos, (int)n, data[pos - 1] == 0x54);
                if (length < 0) return R_NEGATIVE_LENGTH;
                if ((uint64_t)length > (uint64_t)(end - pos)) return R_TRUNCATED; /* pos > end after the push */
                pos += n + length;
                r = push(s, ATOM);
                break;
            }
            case K_EMPTY:
                r = push(s, EMPTY_C);
                break;
            case K_PUT1:
            case K_PUT4:
            case K_PUT_LINE: {
                int64_t index;
                if (kind == K_PUT_LINE) {
                    Py_ssize_t nl = newline_at(s, pos);
                    if (nl < 0) return R_MALFORMED;
                    index = line_index(s, pos, nl, ops);
                    pos = nl + 1;
                } else {
                    if (n == 1 && pos >= end) return R_MALFORMED;
                    index = n == 1 ? data[pos] : from_bytes(s, pos, 4, 0);
                    pos += n;
                }
                if (index < 0 || index > ops || s->sp <= fl) return R_MEMO_RANGE;
                r = memo_set(s, (Py_ssize_t)index, s->stack[s->sp - 1]);
                if (r) return r;
                s->memo_at[s->sp - 1] = (Py_ssize_t)index;
                break;
            }
            case K_BUILD:
            case K_FILL:
            case K_FILL_MARK: {
                Py_ssize_t start;
                if (kind == K_FILL_MARK) {
                    if (!s->nmarks) return R_MALFORMED; /* marks.pop() of nothing */
                    start = s->marks[--s->nmarks];
                    fl = floor_of(s);
                } else {
                    start = s->sp - (kind == K_FILL ? n : 1);
                }
                if (start <= fl) return R_UNDERFLOW;
                if (start > s->sp) start = s->sp; /* stack[start:] is empty */
                if (n && kind != K_BUILD) {
                    r = kind == K_FILL ? hash_keys(s, start, s->sp - start, 2) : hash_keys(s, start, s->sp - start, n);
                    if (r) return r;
                }
                r = fill(s, start);
                break;
            }
            case K_TO_MARK:
            case K_INST: {
                if (kind == K_INST) {
                    Py_ssize_t nl = newline_at(s, pos);
                    if (nl < 0) return R_MALFORMED;
                    nl = newline_at(s, nl + 1);
                    if (nl < 0) return R_MALFORMED;
                    pos = nl + 1;
                }
                if (!s->nmarks) return R_MALFORMED;
                Py_ssize_t start = s->marks[--s->nmarks];
                if (start > s->sp) start = s->sp;
                if (n && kind == K_TO_MARK) {
                    r = hash_keys(s, start, s->sp - start, n);
                    if (r) return r;
                }
                Val v;
                r = container(s, start, s->sp - start, &v);
                if (r) return r;
                s->sp = start;
                r = push(s, v);
                break;
            }
            case K_ATOM_LINES:
            case K_GET_LINE: {
                Py_ssize_t from = pos, nl = pos;
                for (int64_t i = 0; i < n; i++) {
                    nl = newline_at(s, pos);
                    if (nl < 0) return R_MALFORMED;
                    from = pos;
                    pos = nl + 1;
                }
                if (kind == K_GET_LINE)
                    r = get_index(s, line_index(s, from, nl, INT64_MAX / 16));
                else
                    r = push(s, ATOM);
                break;
            }
            case K_POP:
                if (s->nmarks && s->marks[s->nmarks - 1] == s->sp)
                    s->nmarks--;
                else if (s->sp <= fl)
                    return R_UNDERFLOW;
                else
                    s->sp--;
                break;
            case K_POP_MARK: {
                if (!s->nmarks) return R_MALFORMED;
                Py_ssize_t start = s->marks[--s->nmarks];
                if (start < s->sp) s->sp = start;
                break;
            }
            case K_DUP:
            case K_REPLACE:
                if (s->sp <= fl) return R_UNDERFLOW;
                if (kind == K_DUP) {
                    s->inexact = s->inexact || s->stack[s->sp - 1].depth >= 1;
                    r = push(s, s->stack[s->sp - 1]);
                } else {
                    s->stack[s->sp - 1] = ATOM;
                }
                break;
            case K_SKIP:
                pos += n;
                break;
            case K_BIGINT: {
                int64_t length = from_bytes(s, pos, (int)n, n == 4);
                if (length < 0) return R_NEGATIVE_LENGTH;
                pos += n + length;
                Val v = {(uint32_t)((uint64_t)(1 + length / 64) < CAP ? (uint64_t)(1 + length / 64) : CAP), 0};
                r = push(s, v);
                break;
            }
            case K_STOP:
                if (!s->inexact) { /* `not inexact and stack[-1] ...`: the stack is looked at only when exact */
                    if (!s->sp) return R_MALFORMED;
                    if ((int64_t)s->stack[s->sp - 1].size > tree_base + expansion * ops) return R_EXPANSION;
                }
                return s->inexact;
            default:
                return R_MALFORMED;
        }
        if (r) return r;
        if (pos > end) return R_TRUNCATED;
    }
    return R_NO_STOP;
}

static PyObject *scan(PyObject *self, PyObject *args) {
    Py_buffer data, kinds, ns;
    long max_depth;
    long long hash_base, tree_base, expansion;
    if (!PyArg_ParseTuple(args, "y*y*y*lLLL", &data, &kinds, &ns, &max_depth, &hash_base, &tree_base, &expansion)) return NULL;
    if (kinds.len != 256 || ns.len != 256) {
        PyBuffer_Release(&data);
        PyBuffer_Release(&kinds);
        PyBuffer_Release(&ns);
        PyErr_SetString(PyExc_ValueError, "the opcode table has 256 entries");
        return NULL;
    }
    Scan s;
    memset(&s, 0, sizeof s);
    s.data = data.buf;
    s.end = data.len;
    s.kinds = kinds.buf;
    s.ns = ns.buf;
    s.max_depth = max_depth;
    s.hash_left = hash_base + 4 * (int64_t)data.len;
    int verdict;
    Py_BEGIN_ALLOW_THREADS
    verdict = run(&s, tree_base, expansion);
    Py_END_ALLOW_THREADS
    free(s.stack);
    free(s.memo_at);
    free(s.marks);
    free(s.memo);
    PyBuffer_Release(&data);
    PyBuffer_Release(&kinds);
    PyBuffer_Release(&ns);
    if (verdict == R_NO_MEMORY) return PyErr_NoMemory();
    return PyLong_FromLong(verdict);
}

/* The globals a pickle names by text (GLOBAL, INST), in the order the unpickler would ask for them, without
   building its value: a list of (module, name) bytes pairs, or None where only unpickling would tell the names
   (STACK_GLOBAL takes them from the stack, EXT1/2/4 from the copyreg registry) or the opcodes do not walk (the
   unpickler then says what is wrong). The walk ends at the first STOP, as the unpickler does. Only the arguments'
   sizes are read: the same reading of them as `run`. */
static PyObject *text_globals(const unsigned char *data, Py_ssize_t end, const unsigned char *kinds, const unsigned char *ns) {
    PyObject *found = PyList_New(0);
    if (!found) return NULL;
    Py_ssize_t pos = 0;
    while (pos < end) {
        unsigned char op = data[pos], kind = kinds[op];
        int64_t n = ns[op];
        pos += 1;
        if (kind == K_NONE || op == 0x93 || op == 0x82 || op == 0x83 || op == 0x84) break; /* STACK_GLOBAL, EXT1/2/4 */
        int64_t length = 0, lines = 0;
        switch (kind) {
            case K_GET1: case K_GET4: case K_PUT1: case K_PUT4: case K_ATOM: case K_SKIP:
                length = n;
                break;
            case K_ATOM_LEN:
            case K_BIGINT: {
                if (pos + n > end) goto undecided;
                int is_signed = kind == K_BIGINT ? n == 4 : op == 0x54;
                uint64_t v = 0;
                for (int i = (int)n - 1; i >= 0; i--) v = (v << 8) | data[pos + i];
                if (is_signed && n < 8 && (data[pos + n - 1] & 0x80)) goto undecided; /* negative */
                if (v > (uint64_t)(end - pos - n)) goto undecided;
                length = n + (int64_t)v;
                break;
            }
            case K_ATOM_LINES: case K_GET_LINE:
                lines = n;
                break;
            case K_PUT_LINE:
                lines = 1;
                break;
            case K_INST:
                lines = 2;
                break;
            case K_STOP:
                return found;
            default:
                break;
        }
        if (length > end - pos) goto undecided;
        pos += length;
        if (lines) {
            const unsigned char *first = data + pos, *nl = NULL;
            Py_ssize_t first_len = 0;
            for (int64_t i = 0; i < lines; i++) {
                nl = pos < end ? memchr(data + pos, '\n', end - pos) : NULL;
                if (!nl) goto undecided;
                if (i == 0) first_len = nl - first;
                pos = nl - data + 1;
            }
            if (op == 'c' || op == 'i') {
                const unsigned char *second = first + first_len + 1;
                PyObject *pair = Py_BuildValue("(y#y#)", first, first_len, second, (Py_ssize_t)(nl - second));
                if (!pair || PyList_Append(found, pair) < 0) {
                    Py_XDECREF(pair);
                    Py_DECREF(found);
                    return NULL;
                }
                Py_DECREF(pair);
            }
        }
    }
undecided:
    Py_DECREF(found);
    Py_RETURN_NONE;
}

static PyObject *named_globals(PyObject *self, PyObject *args) {
    Py_buffer data, kinds, ns;
    if (!PyArg_ParseTuple(args, "y*y*y*", &data, &kinds, &ns)) return NULL;
    PyObject *out;
    if (kinds.len != 256 || ns.len != 256) {
        PyErr_SetString(PyExc_ValueError, "the opcode table has 256 entries");
        out = NULL;
    } else {
        out = text_globals(data.buf, data.len, kinds.buf, ns.buf);
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&kinds);
    PyBuffer_Release(&ns);
    return out;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS, "scan(data, kinds, ns, max_depth, hash_base, tree_base, expansion) -> verdict"},
    {"named_globals", named_globals, METH_VARARGS, "named_globals(data, kinds, ns) -> [(module, name)] or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pickle_scan", NULL, -1, methods};

PyMODINIT_FUNC PyInit__pickle_scan(void) { return PyModule_Create(&module); }
