/*
 * mdcr: create/remove metadata benchmark for birchbench (W3).
 *
 * In the spirit of `mdtest -F -C -r -u`: files only, a create phase then a
 * remove phase, every thread in its own ("unique") directory.  Each thread
 * creates FILES empty files with open(O_CREAT|O_EXCL|O_WRONLY) + close, all
 * threads wait at a barrier, then each unlinks its files.  The phase time is
 * measured by the main thread from the barrier that releases the threads to
 * the barrier that all of them reach when done, so the rate is the aggregate
 * one (total files / wall time of the slowest thread), as mdtest reports it.
 *
 * usage: mdcr DIR THREADS FILES_PER_THREAD
 * prints one JSON object on stdout.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

static pthread_barrier_t bar;
static const char *base;
static long nfiles;
static volatile int failed;

struct targ {
    int id;
    int dfd;
    long created;
    long removed;
    int err;
};

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void *worker(void *p)
{
    struct targ *t = p;
    char name[64];

    pthread_barrier_wait(&bar); /* start create */
    for (long i = 0; i < nfiles && !failed; i++) {
        snprintf(name, sizeof name, "file.mdtest.%d.%ld", t->id, i);
        int fd = openat(t->dfd, name, O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
        if (fd < 0) {
            t->err = errno;
            failed = 1;
            break;
        }
        close(fd);
        t->created++;
    }
    pthread_barrier_wait(&bar); /* create done */
    pthread_barrier_wait(&bar); /* start remove */
    for (long i = 0; i < t->created; i++) {
        snprintf(name, sizeof name, "file.mdtest.%d.%ld", t->id, i);
        if (unlinkat(t->dfd, name, 0) < 0) {
            if (!t->err)
                t->err = errno;
            failed = 1;
            break;
        }
        t->removed++;
    }
    pthread_barrier_wait(&bar); /* remove done */
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: %s DIR THREADS FILES_PER_THREAD\n", argv[0]);
        return 2;
    }
    base = argv[1];
    int nthreads = atoi(argv[2]);
    nfiles = atol(argv[3]);
    if (nthreads < 1 || nfiles < 1) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    struct targ *ts = calloc(nthreads, sizeof *ts);
    pthread_t *th = calloc(nthreads, sizeof *th);
    if (!ts || !th)
        return 1;
    for (int i = 0; i < nthreads; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/mdtest_tree.%d", base, i);
        if (mkdir(path, 0755) < 0 && errno != EEXIST) {
            perror(path);
            return 1;
        }
        ts[i].id = i;
        ts[i].dfd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (ts[i].dfd < 0) {
            perror(path);
            return 1;
        }
    }
    pthread_barrier_init(&bar, NULL, nthreads + 1);
    for (int i = 0; i < nthreads; i++)
        pthread_create(&th[i], NULL, worker, &ts[i]);

    pthread_barrier_wait(&bar);
    double c0 = now();
    pthread_barrier_wait(&bar);
    double c1 = now();
    pthread_barrier_wait(&bar);
    double r0 = now();
    pthread_barrier_wait(&bar);
    double r1 = now();
    long created = 0, removed = 0;
    int err = 0;
    for (int i = 0; i < nthreads; i++) {
        pthread_join(th[i], NULL);
        created += ts[i].created;
        removed += ts[i].removed;
        if (ts[i].err && !err)
            err = ts[i].err;
        close(ts[i].dfd);
    }
    for (int i = 0; i < nthreads; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/mdtest_tree.%d", base, i);
        rmdir(path);
    }
    double cs = c1 - c0, rs = r1 - r0;
    printf("{\"threads\": %d, \"files_per_thread\": %ld, \"created\": %ld, \"removed\": %ld, "
           "\"create_s\": %.6f, \"remove_s\": %.6f, \"creates_per_s\": %.1f, "
           "\"removes_per_s\": %.1f, \"error\": \"%s\"}\n",
           nthreads, nfiles, created, removed, cs, rs, cs > 0 ? created / cs : 0.0,
           rs > 0 ? removed / rs : 0.0, err ? strerror(err) : "");
    return err ? 1 : 0;
}
