// Tiny MPI program: every rank contributes rank+1; all must see the sum 1+...+size.
#include <mpi.h>

#include <cstdio>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  int mine = rank + 1, total = 0;
  MPI_Allreduce(&mine, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  const int expected = size * (size + 1) / 2;
  int ok = (total == expected && size == 2) ? 1 : 0;
  if (rank == 0) std::printf("mpi_hello: size=%d total=%d %s\n", size, total, ok ? "OK" : "FAIL");
  MPI_Finalize();
  return ok ? 0 : 1;
}
