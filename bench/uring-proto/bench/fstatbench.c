/* fstatbench FILE N: open FILE (created), fstat it N times; prints us per call. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec/1e9;}
int main(int argc,char**argv){
  if(argc!=3){fprintf(stderr,"usage\n");return 2;}
  long n=atol(argv[2]);
  int fd=open(argv[1],O_RDWR|O_CREAT,0644); if(fd<0){perror("open");return 1;}
  struct stat st;
  for(int i=0;i<1000;i++) fstat(fd,&st);
  double t0=now();
  for(long i=0;i<n;i++) if(fstat(fd,&st)){perror("fstat");return 1;}
  double t1=now();
  close(fd);
  printf("{\"calls\": %ld, \"s\": %.6f, \"us_per_call\": %.3f}\n",n,t1-t0,(t1-t0)*1e6/n);
  return 0;
}
