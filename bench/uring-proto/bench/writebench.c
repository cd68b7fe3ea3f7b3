/* writebench DIR THREADS MIB_PER_THREAD BS: each thread creates DIR/wb.N with O_DIRECT and
 * writes MIB sequentially in BS-byte pwrites; aggregate MB/s (MiB/s). Files removed after. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec/1e9;}
static pthread_barrier_t bar; static const char*dir; static long bytes; static long bs; static int fail;
static void*w(void*p){long id=(long)p;char path[4096];snprintf(path,sizeof path,"%s/wb.%ld",dir,id);
  int fd=open(path,O_CREAT|O_TRUNC|O_WRONLY|O_DIRECT,0644); if(fd<0){perror(path);fail=1;}
  void*buf; posix_memalign(&buf,4096,bs); memset(buf,'a'+id,bs);
  pthread_barrier_wait(&bar);
  if(fd>=0) for(long off=0;off<bytes;off+=bs) if(pwrite(fd,buf,bs,off)!=bs){perror("pwrite");fail=1;break;}
  pthread_barrier_wait(&bar);
  if(fd>=0)close(fd); unlink(path); return 0;}
int main(int argc,char**argv){
  if(argc!=5){fprintf(stderr,"usage\n");return 2;}
  dir=argv[1]; int n=atoi(argv[2]); bytes=atol(argv[3])<<20; bs=atol(argv[4]);
  pthread_barrier_init(&bar,0,n+1); pthread_t th[64];
  for(long i=0;i<n;i++) pthread_create(&th[i],0,w,(void*)i);
  pthread_barrier_wait(&bar); double t0=now(); pthread_barrier_wait(&bar); double t1=now();
  for(int i=0;i<n;i++) pthread_join(th[i],0);
  printf("{\"threads\": %d, \"s\": %.6f, \"mib_per_s\": %.1f, \"writes_per_s\": %.0f, \"error\": %d}\n",n,t1-t0,n*bytes/1048576.0/(t1-t0),n*(double)bytes/bs/(t1-t0),fail);
  return fail;}
